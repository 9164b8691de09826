"""comera_dist.metrics"""
