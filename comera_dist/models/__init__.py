"""comera_dist.models"""
