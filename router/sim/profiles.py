"""Named cost profiles: how long prefill and decode take on a given model and GPU.

Prefill of ``n`` uncached prompt tokens costs ``prefill_a_s * n + prefill_b_s * n**2`` seconds
(linear: the weight matmuls; quadratic: attention over the prompt). One decode step — one token
for every running sequence — costs ``decode_base_s + decode_per_seq_s * batch`` seconds: at
small batches decode is bound by reading the weights once per step, and every extra sequence
adds its KV-cache reads and a sliver of compute. The figures and where they come from:

``h100-7b`` (a Llama-2-7B-class model on one H100 SXM 80 GB under vLLM; the project's design
figures "4K-token prefill in 50-80 ms, decode 8-15 ms per token", checked against the hardware):
  - prefill ``a`` = 12.5 us/token: a 7B model costs 2 * 7e9 = 14 GFLOP per token, and the
    H100's dense BF16 peak is 989 TFLOP/s, so 14.2 us/token is full-peak BF16 (12.5 us needs
    FP8 GEMMs at ~57 % of their 1,979 TFLOP/s peak): a best-case, well-tuned server.
    ``b`` = 0.9 ns/token^2: causal attention is 2 * layers * d * n^2 FLOP = 4.4 TFLOP at 4,096
    tokens, ~15 ms at flash-attention's lower efficiency. 4,096 tokens: 51 + 15 = 66 ms.
  - decode ``decode_base`` = 10 ms: reading 13.5 GB of BF16 weights at 3.35 TB/s is 4.0 ms at
    best; single-stream vLLM runs of 7B models on an H100 report ~100 tokens/s.
    ``decode_per_seq`` = 0.15 ms: each sequence's KV-cache reads and sampling; 64 sequences
    make a ~20 ms step (~3,200 tokens/s aggregate).
  - KV cache: (80 GB * 0.9 - 13.5 GB weights) / 512 KiB per token (2 * 32 layers * 4096 *
    2 bytes) = ~112K tokens = ~7,200 blocks of 16 tokens (vLLM logs this as "GPU KV cache size").
  - tokenizing ``tokenize_per_token`` = 0.125 us/token: the server's frontend runs a Rust BPE
    tokenizer (HF ``tokenizers``) over the templated prompt before scheduling it, ~1 ms for
    8K tokens; charged whether or not the prefix is cached (the text is tokenized anyway).
``consumer-7b`` (the same model in FP16 on one RTX 4090 24 GB):
  - prefill ``a`` = 200 us/token: 14 GFLOP per token at the 4090's 165 TFLOP/s dense FP16
    (FP32 accumulate) peak and ~40 % MFU; ``b`` = 8 ns/token^2: 4K tokens in ~0.95 s.
  - decode ``decode_base`` = 22 ms: 13.5 GB of weights at 1,008 GB/s is 13.4 ms at best;
    ``decode_per_seq`` = 0.5 ms (a smaller GPU saturates sooner).
  - KV cache: (24 GB * 0.9 - 13.5 GB) / 512 KiB = ~15K tokens = 900 blocks.
  - tokenizing: as ``h100-7b`` (the CPU's work, not the GPU's).
``instant``: zero cost, for fast functional tests and for measuring the sim's own CPU cost.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "Profile", "get_profile"]


@dataclass(frozen=True, slots=True)
class Profile:
    """A cost model and the server defaults that go with it. All durations in seconds."""

    name: str
    model: str
    """The model id served (``/v1/models``, ``model`` in responses)."""
    prefill_a_s: float
    """Seconds per uncached prompt token (linear term)."""
    prefill_b_s: float
    """Seconds per uncached prompt token squared (attention term)."""
    decode_base_s: float
    """Seconds per decode step, independent of the batch (weight reads)."""
    decode_per_seq_s: float
    """Extra seconds per decode step for each running sequence."""
    max_num_seqs: int
    """Default ``--max-num-seqs``: sequences decoded together."""
    prefix_cache_blocks: int
    """Default ``--prefix-cache-blocks``: KV-cache capacity in 16-token blocks."""
    description: str
    max_model_len: int = 32768
    """Default ``--max-model-len``: the context length ``/v1/models`` reports."""
    tokenize_per_token_s: float = 0.0
    """Seconds per prompt token the frontend spends tokenizing before the engine sees it."""

    def prefill_s(self, uncached_tokens: int) -> float:
        n = uncached_tokens
        return self.prefill_a_s * n + self.prefill_b_s * n * n

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def tokenize_s(self, prompt_tokens: int) -> float:
        """The frontend's time to tokenize a prompt (the sim charges this, not its own CPU)."""
        return self.tokenize_per_token_s * prompt_tokens


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="h100-7b",
            model="sim-llama-7b",
            prefill_a_s=12.5e-6,
            prefill_b_s=0.9e-9,
            decode_base_s=10e-3,
            decode_per_seq_s=0.15e-3,
            max_num_seqs=256,
            prefix_cache_blocks=7200,
            description="7B FP16 on one H100 SXM: 4K-token prefill ~66 ms, decode ~10 ms/token",
            tokenize_per_token_s=0.125e-6,
        ),
        Profile(
            name="consumer-7b",
            model="sim-llama-7b",
            prefill_a_s=200e-6,
            prefill_b_s=8e-9,
            decode_base_s=22e-3,
            decode_per_seq_s=0.5e-3,
            max_num_seqs=64,
            prefix_cache_blocks=900,
            description="7B FP16 on one RTX 4090: 4K-token prefill ~0.95 s, decode ~22 ms/token",
            tokenize_per_token_s=0.125e-6,
        ),
        Profile(
            name="instant",
            model="sim-instant",
            prefill_a_s=0.0,
            prefill_b_s=0.0,
            decode_base_s=0.0,
            decode_per_seq_s=0.0,
            max_num_seqs=256,
            prefix_cache_blocks=100_000,
            description="zero cost: for functional tests and the sim's own CPU benchmark",
        ),
    )
}


def get_profile(name: str) -> Profile:
    """The named profile; ``KeyError`` naming the valid choices otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(
            f"unknown profile {name!r}; choose one of: {', '.join(sorted(PROFILES))}"
        ) from None
