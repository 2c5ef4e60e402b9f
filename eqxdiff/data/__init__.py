"""eqxdiff.data"""
