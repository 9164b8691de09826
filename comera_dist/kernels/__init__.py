"""comera_dist.kernels"""
