"""comera_dist.layers"""
