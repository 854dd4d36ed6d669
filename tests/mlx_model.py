"""The MLX tests' model and tokenizer: the package's own offline demo builders."""

from kvstore.demo.model import *  # noqa: F401,F403
from kvstore.demo.model import SPECIAL_TOKENS, VOCAB_SIZE  # noqa: F401
