"""eqxdiff.parallel"""
