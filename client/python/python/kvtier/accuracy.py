"""How close a model's next-token distributions stay when its KV went through a lossy codec.

`score_codecs` stores a prefix's KV with each codec, reloads it, and scores the next tokens (teacher
forcing) against a reload of the raw KV: mean KL(raw || codec) of the next-token distribution,
top-1 agreement, and perplexity of the continuation under each. `python -m kvtier.accuracy --help`
runs it on a real model.
"""

import dataclasses

import torch


@dataclasses.dataclass
class Agreement:
    """Next-token agreement of `logits` with reference logits over the same positions."""

    positions: int
    kl_mean: float
    kl_max: float
    top1: float
    ppl_ref: float
    ppl: float

    def as_dict(self):
        return dataclasses.asdict(self)


def compare_logits(ref, got, targets=None):
    """`ref`, `got`: `[positions, vocab]` logits; `targets`: the tokens that followed (for
    perplexity), or None."""
    ref, got = ref.float(), got.float()
    lp_ref = torch.log_softmax(ref, dim=-1)
    lp = torch.log_softmax(got, dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    if targets is not None:
        t = torch.as_tensor(targets).view(-1, 1)
        ppl_ref = torch.exp(-lp_ref.gather(1, t).mean()).item()
        ppl = torch.exp(-lp.gather(1, t).mean()).item()
    else:
        ppl_ref = ppl = float("nan")
    return Agreement(len(ref), kl.mean().item(), kl.max().item(), top1, ppl_ref, ppl)


def continuation_logits(store, cache, prefix_len, continuation):
    """Logits at every position of `continuation` fed after a cache holding `prefix_len` tokens:
    row `i` predicts `continuation[i + 1]` (the last row predicts what follows)."""
    assert cache.get_seq_length() == prefix_len
    with torch.no_grad():
        out = store.model(input_ids=torch.tensor([list(continuation)]), use_cache=True, **{store._kw: cache})
    return out.logits[0].float()


def score_codecs(make_store, codecs, tokens, prefix_len, score_len):
    """For each codec: store `tokens[:prefix_len]`'s KV with it (computed once, raw), reload it,
    and compare the logits over `tokens[prefix_len : prefix_len + score_len]` with those from a
    raw reload. `make_store(codec)` returns a `KvCacheStore` for that codec in a namespace of its
    own. Returns `{codec: Agreement}` (raw against itself included, as a check)."""
    tokens = list(tokens)
    prefix, cont = tokens[:prefix_len], tokens[prefix_len : prefix_len + score_len + 1]
    raw = make_store("raw")
    step = raw.prefill(prefix, reuse=False, store=False)
    kv = raw.cache_to_blocks(step.cache, 0, prefix_len - prefix_len % raw.block_tokens)
    n = kv.numel() * kv.element_size() // raw.ns.token_bytes
    results = {}
    ref = None
    for codec in ["raw", *[c for c in codecs if c != "raw"]]:
        st = make_store(codec)
        stored = st.client.store(st.ns, prefix[:n], kv)
        if stored * st.block_tokens != n:
            raise RuntimeError(f"{codec}: stored {stored} blocks of {n // st.block_tokens}")
        cache, got = st.load(prefix[:n])
        if got != n:
            raise RuntimeError(f"{codec}: reloaded {got} tokens of {n}")
        logits = continuation_logits(st, cache, n, prefix[n:] + cont)
        # Score only the positions after the prefix proper.
        logits = logits[prefix_len - n : prefix_len - n + score_len]
        if ref is None:
            ref = logits
        results[codec] = compare_logits(ref, logits, cont[1 : score_len + 1])
    return results
