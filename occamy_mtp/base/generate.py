"""Batched decoding with the frozen base: how the base writes its own text.

`plain_decode` (transformers' forward with its cache, one step at a time: the plain decoder beside the
static one, `base.fastdecode.BatchDecoder`) is what the self-generated store (`occamy_mtp.selfgen.store`) and the
answer-regeneration command (`occamy_mtp.selfgen.regenerate`) decode with: greedy, or sampled under a
`sampling.TextSampling` from one seeded uniform stream per prompt, until one of the stop
tokens (`data.windows.stop_token_ids`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from occamy_mtp.compat import cache_kwarg
from occamy_mtp.model.sharding import all_finished
from occamy_mtp.sampling import GREEDY_TEXT, TextSampling, draw

# Any id works for padding: padded positions are masked out of every layer (see _greedy_batch).
PAD_INPUT_ID = 0


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """What every greedy decoder of the library refuses: no new token asked for, an empty prompt."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    empty = [index for index, prompt in enumerate(prompts) if len(prompt) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty: greedy decoding needs at least one token")


def check_uniforms(prompts: Sequence[Sequence[int]], sampling: TextSampling, uniforms, max_new_tokens: int) -> None:
    """Sampled decoding needs one stream of at least `max_new_tokens` uniforms per prompt."""
    if sampling.greedy:
        return
    if uniforms is None or len(uniforms) != len(prompts):
        raise ValueError(f"sampled decoding needs one uniform stream per prompt ({len(prompts)}), got "
                         f"{'none' if uniforms is None else len(uniforms)}")
    short = [i for i, stream in enumerate(uniforms) if len(stream) < max_new_tokens]
    if short:
        raise ValueError(f"uniform stream {short[0]} holds {len(uniforms[short[0]])} values, fewer than max_new_tokens={max_new_tokens}")


@torch.no_grad()
def plain_decode(
    base,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    batch_size: int,
    sampling: TextSampling = GREEDY_TEXT,
    uniforms: Sequence[torch.Tensor] | None = None,
) -> list[list[int]]:
    """Continuations of `prompts` by the frozen base, greedy, `batch_size` prompts at a time; under a
    sampled `sampling`, the j-th new token of prompt r is `sampling.draw(p, uniforms[r][j])`, p the
    base's processed distribution there, so a continuation depends on its own stream only.

    `base` is a transformers Qwen3.5-MoE / Qwen3-Next causal LM, or the `base.frozen.FrozenBase` holding one
    on any device. Returns, per prompt and in order, the generated token ids: up to
    `max_new_tokens` of them, ending with the first token in `eos_token_ids` when one is
    generated (it is included; a continuation is finished iff its last id is in the set).

    Equal to decoding each prompt alone with a full forward per step (no cache, no
    padding): checked token for token by the tests on tiny fp32 models, with prompts of
    different lengths in one batch. "Equal" is up to floating point: the batched cached
    path sums in a different order (recurrent vs chunked delta rule, padded chunk
    alignment, batch-dependent matmul blocking), so a near-tie between the top two
    logits can in principle resolve differently; in bf16 on a GPU such ties are real: on
    random tiny models there, fp32 was identical and bf16 parted a row now and then from the
    one-by-one reference, itself just another summation order. The same prompts in the same batches on the same
    machine give the same tokens.

    Why not `base.generate`: it would apply the checkpoint's generation_config
    (repetition penalty, top-k...) unless every field is overridden, and its handling of
    the hybrid model's padding is not ours to pin. Here, rows are left-padded; the
    attention mask removes padded keys from full attention, transformers'
    `apply_mask_to_padding_states` zeroes padded inputs of the Gated DeltaNet layers
    (zero inputs leave their conv and recurrent states at zero, as if the row started at
    its first real token), and position ids count from each row's first real token.
    """
    check_prompts(prompts, max_new_tokens)
    check_uniforms(prompts, sampling, uniforms, max_new_tokens)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    eos = frozenset(int(token) for token in eos_token_ids)
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        streams = None if sampling.greedy else torch.stack([u[:max_new_tokens] for u in uniforms[start : start + batch_size]])
        out.extend(_greedy_batch(base, [list(p) for p in prompts[start : start + batch_size]], max_new_tokens, eos,
                                 sampling, streams))
    return out


def idle_decode(base, max_new_tokens: int) -> None:
    """The forwards a process of a sharded base (`model.sharding`) runs while the others decode and it
    has no rows of its own: one padding row, finished from the start, stepped until every process's
    rows have stopped (the base's forwards are collective)."""
    _greedy_batch(base, [[PAD_INPUT_ID]], max_new_tokens, frozenset(), idle=True)


def _greedy_batch(base, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int],
                  sampling: TextSampling = GREEDY_TEXT, uniforms: torch.Tensor | None = None,
                  idle: bool = False) -> list[list[int]]:
    from transformers import DynamicCache

    device = base.lm_head.weight.device
    rows, longest = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((rows, longest), PAD_INPUT_ID, dtype=torch.long)
    attention_mask = torch.zeros((rows, longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every row's next token is at the end
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, longest - len(prompt) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T): 0 at each row's first real token
    cache = DynamicCache(config=base.config)  # KV for full attention, conv + recurrent state for DeltaNet
    cache_argument = {cache_kwarg(base.forward): cache}

    generated: list[list[int]] = [[] for _ in prompts]
    finished = [idle] * rows
    step_ids, step_positions = input_ids, position_ids
    # What penalties read (`sampling.penalized`): each row's prompt, and its answer so far (-1: none yet).
    prompt_ids = input_ids.masked_fill(attention_mask == 0, -1)
    answer_ids = torch.full((rows, max_new_tokens), -1, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        logits = base(
            input_ids=step_ids,
            attention_mask=attention_mask,
            position_ids=step_positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_argument,
        ).logits[:, -1]  # (B, V)
        if sampling.greedy:
            next_ids = logits.argmax(dim=-1)  # (B,): ties go to the lowest id, as in the unbatched reference
        else:
            history = (answer_ids, prompt_ids) if sampling.penalized else None
            next_ids = draw(sampling.probs(logits, history), uniforms[:, step].to(logits.device))
        answer_ids[:, step] = next_ids
        for row, token in enumerate(next_ids.tolist()):
            if not finished[row]:
                generated[row].append(token)
                finished[row] = token in eos
        if all_finished(all(finished), base, device):  # a sharded base decodes until every process's rows stop
            break
        # Finished rows keep decoding (their tokens are discarded) so the batch keeps its shape.
        step_ids = next_ids[:, None]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((rows, 1))], dim=1)
        step_positions = step_positions[:, -1:] + 1
    return generated
