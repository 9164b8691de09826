"""comera_dist.layers: TT/TTM nn.Modules (TTLinear, TTEmbedding, TiedTTHead) over the shared TensorizedModule base."""

from comera_dist.layers.base import TensorizedModule
from comera_dist.layers.embedding import TTEmbedding
from comera_dist.layers.linear import TTLinear
from comera_dist.layers.tied_head import TiedTTHead
from comera_dist.tensor.smallops import inside_checkpoint  # the layers' CPU contractions inside a checkpoint

__all__ = ["TTEmbedding", "TTLinear", "TensorizedModule", "TiedTTHead", "inside_checkpoint"]
