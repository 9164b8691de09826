"""comera_dist.compression"""
