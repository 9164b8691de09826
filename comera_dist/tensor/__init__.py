"""comera_dist.tensor"""
