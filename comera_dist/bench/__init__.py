"""comera_dist.bench"""
