"""comera_dist.layers: TT/TTM nn.Modules (TTLinear, TTEmbedding) over the shared TensorizedModule base."""

from comera_dist.layers.base import TensorizedModule
from comera_dist.layers.embedding import TTEmbedding
from comera_dist.layers.linear import TTLinear

__all__ = ["TTEmbedding", "TTLinear", "TensorizedModule"]
