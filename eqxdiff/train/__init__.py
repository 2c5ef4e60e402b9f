"""eqxdiff.train"""
