"""comera_dist.engine"""
