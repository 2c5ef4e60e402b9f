"""eqxdiff.schedulers"""
