"""eqxdiff.pipelines"""
