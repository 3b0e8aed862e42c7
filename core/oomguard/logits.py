"""Logits memory as vLLM 0.33 holds it: the one formula `budget`, `preflight`, the request guard
and the GPU twin share.

Where the bytes come from (vLLM 0.33.0; line numbers of the installed package):

- **Prompt logprobs** (`vllm/v1/worker/gpu_model_runner.py`, `_get_prompt_logprobs_dict`,
  5245-5352): for each request with `prompt_logprobs`, per prefill chunk,
  `logits = self.model.compute_logits(prompt_hidden_states)` (5314): one row per prompt token of
  the chunk, the full vocabulary in the model dtype (the logits processor all-gathers the TP
  shards, so every rank holds every column); then `self.sampler.compute_logprobs(logits)` (5327),
  which is `logits.log_softmax(dim=-1, dtype=torch.float32)` (`vllm/v1/sample/sampler.py` 370).
  PyTorch's `log_softmax` with a dtype (aten/src/ATen/native/SoftMax.cpp, `log_softmax`) casts the
  input first (`input_.toType(dtype)`: an FP32 copy) unless the input is FP16 on CUDA, where the
  kernel upcasts inside (`_log_softmax(input_, dim_, true)`). So a BF16 model holds, per prompt
  token of the chunk, 2 B of logits + 4 B of FP32 copy + 4 B of FP32 log-softmax at the peak
  (10 B x vocab), and 2 + 4 = 6 B once the copy is freed (the "2 B logits + 4 B FP32
  log-softmax" usually quoted); an FP16 model on CUDA 2 + 4 = 6 B at the peak; an FP32 model
  4 + 4 = 8 B (`toType` of an FP32 tensor is the tensor itself). `gather_logprobs` (sampler.py
  373-421) adds only top-k rows and a fused count (`batched_count_greater_than` is compiled so it
  makes no copy). With chunked prefill a chunk is at most `max_num_batched_tokens` tokens; the
  last chunk computes `prompt - 1` rows at most. Without `prompt_logprobs` a prefill computes
  logits only for the last token of each request (`logits_indices`): that is the sampler's.
- **The sampler** (sampler.py `Sampler.forward`, 130-210): the sampled rows' logits in the model
  dtype, `logits.to(torch.float32)` (158), the softmax and the exponential noise of random
  sampling: 2 + 4 + 4 + 4 = 14 B per row x vocab. vLLM's profile runs it for `max_num_seqs` rows
  (`gpu_model_runner._dummy_sampler_run`, `max_num_logprobs=None`), so a plain request is
  budgeted. vLLM 0.9-0.11's PyTorch sort sampler needed ~38 B (docs/budget.md, "Sampler").
- **Top logprobs** (`logprobs=k` on a sampled token): `raw_logprobs =
  self.compute_logprobs(logits)` (150) before sampling, alive until the gather: 4 B x vocab per
  sampled sequence (`n` of them) beyond the profiled sampler, whose peak it joins.

Pure arithmetic over integers: no vLLM import (the guard calls it per request).
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_BYTES = 4
SAMPLER_BYTES_PER_LOGIT = 14  # model-dtype logits 2 + FP32 copy 4 + softmax 4 + noise 4
SORT_SAMPLER_BYTES_PER_LOGIT = 38  # vLLM 0.9-0.11 without the FlashInfer sampler


@dataclass(frozen=True)
class LogitsShape:
    """What decides a model's logits memory: its vocabulary and the dtype it computes logits in
    (the model dtype: 2 for BF16/FP16, 4 for FP32), and whether FP16 logits upcast inside the
    kernel (FP16 on CUDA)."""

    vocab_size: int
    dtype_bytes: int = 2
    fp16: bool = False

    @property
    def _cast_copy(self) -> int:
        # log_softmax(dtype=float32) copies its input to FP32 first, except FP16 on CUDA
        # (upcast inside the kernel) and FP32 input (no cast at all)
        return 0 if self.fp16 or self.dtype_bytes >= FP32_BYTES else FP32_BYTES

    @property
    def prompt_logprobs_bytes_per_token(self) -> int:
        """Peak bytes per prompt token of a chunk with `prompt_logprobs`."""
        return self.vocab_size * (self.dtype_bytes + FP32_BYTES + self._cast_copy)

    @property
    def prompt_logprobs_resting_bytes_per_token(self) -> int:
        """The same once `log_softmax` has returned (logits + FP32 log-softmax)."""
        return self.vocab_size * (self.dtype_bytes + FP32_BYTES)

    def prompt_logprobs_peak(self, chunk_tokens: int) -> int:
        """Bytes a prefill chunk of `chunk_tokens` prompt tokens holds for `prompt_logprobs`."""
        return max(0, chunk_tokens) * self.prompt_logprobs_bytes_per_token

    def top_logprobs_bytes(self, sequences: int) -> int:
        """Bytes beyond the profiled sampler for top `logprobs` on `sequences` sampled rows."""
        return max(0, sequences) * self.vocab_size * FP32_BYTES

    def sampler_peak(self, rows: int, sort_sampler: bool = False) -> int:
        """The sampler's peak for `rows` sampled rows (what vLLM's profile reserves)."""
        per = SORT_SAMPLER_BYTES_PER_LOGIT if sort_sampler else SAMPLER_BYTES_PER_LOGIT
        return max(0, rows) * self.vocab_size * per


def prefill_chunk(prompt_tokens: int, max_num_batched_tokens: int, chunked_prefill: bool) -> int:
    """Tokens of a prompt's largest prefill chunk."""
    return min(prompt_tokens, max_num_batched_tokens) if chunked_prefill else prompt_tokens


def longest_prompt_logprobs_prompt(
    room_bytes: int,
    shape: LogitsShape,
    max_num_batched_tokens: int,
    chunked_prefill: bool,
    max_model_len: int,
) -> int:
    """The longest prompt whose `prompt_logprobs` chunk fits `room_bytes` (0: none does).

    With chunked prefill each chunk is at most `max_num_batched_tokens` tokens: if that chunk
    fits, any prompt up to `max_model_len` does; otherwise the prompts that fit are the ones
    that come in one chunk small enough. Without chunked prefill the whole prompt is one chunk.
    """
    fits = max(0, room_bytes) // max(1, shape.prompt_logprobs_bytes_per_token)
    if chunked_prefill and fits >= max_num_batched_tokens:
        return max_model_len
    return int(min(fits, max_model_len))
