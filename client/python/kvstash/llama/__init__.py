"""kvstash.llama - a Llama-2 worker in PyTorch whose KV cache lives in kvstashd.

`python3 -m kvstash.llama score|generate [options]` runs a llama2.c
checkpoint (stories260K, stories15M) with kvstash-llama's commands and
options (client/llama/main.c): the forward pass is PyTorch (fp32), the KV
cache is kvstashd's pool, written and gathered through numpy/torch views of
the mapped blocks by the sequence's block table (INT8 blocks dequantised in
torch), and every policy gets the statistics it asks for. `--no-daemon` runs
the same pass over an in-process cache. Modules, one job each:

  checkpoint  the llama2.c checkpoint as torch tensors
  tokenizer   the llama2.c BPE tokenizer
  model       the forward pass pieces and the batched decode attention
  pool        the pool as tensors: writes, gathers, INT8 dequantisation
  policies    what each policy needs, --budget mapping, confidence
  cache       one lane's cache: table following, statistics, steps
  runner      lanes and the batched forward pass
  cli         the command line (parsed before torch is imported)
  commands    the score and generate commands
"""
from .cli import main

__all__ = ["main"]
