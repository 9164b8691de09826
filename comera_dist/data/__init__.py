"""comera_dist.data"""
