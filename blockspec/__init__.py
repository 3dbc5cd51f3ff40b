"""blockspec: DFlash block-diffusion speculative decoding in plain PyTorch."""

from blockspec.errors import BlockspecError
from blockspec.llm import LLM, RequestOutput
from blockspec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "BlockspecError"]
