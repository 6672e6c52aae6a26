"""kvtier for Hugging Face transformers: store a prompt's KV cache as blocks keyed by its token
prefix (or park it as an agent session), and rebuild a `DynamicCache` from kvtier later — in this
process or another — so only the tokens kvtier lacks are prefilled.

    store = kvtier.transformers.KvCacheStore(kvtier.Client(addr), model, model_id="my-model@rev")
    step = store.prefill(prompt_ids)            # reuses the longest stored prefix, stores the rest
    tokens, _ = store.greedy(step, 32)          # or hand `step.cache` to your own decoding loop

Blocks use kvtier's layer-first layout, `[layer][k|v][token][head][dim]` per block of
`block_tokens` tokens, in the model's dtype; the namespace's codec (raw, fp8, nvfp4, ...) decides
what goes over the wire. At least one token of every prompt is always prefilled, because the
engine needs its logits.
"""

import dataclasses
import hashlib
import inspect
import json

try:
    import torch
    from transformers import DynamicCache
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvtier.transformers needs torch and transformers 5 (pip install 'kvtier[transformers]'): {e}"
    ) from e

from . import Client, Namespace

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cache_kwarg(model):
    """The forward() keyword that takes the KV cache (`cache` in transformers 5.x, formerly
    `past_key_values`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_fingerprint(model):
    """A fingerprint of a model's architecture (its config). It does not see the weights: pass
    `model_id` with a weights revision when two checkpoints share a config."""
    cfg = model.config.to_dict()
    blob = json.dumps(cfg, sort_keys=True, default=str).encode()
    return f"{cfg.get('model_type', 'model')}:{hashlib.blake2b(blob, digest_size=8).hexdigest()}"


@dataclasses.dataclass
class Step:
    """The result of a prefill: the last position's logits, the cache (covering every prompt
    token), the prompt, and how many of its tokens came from kvtier instead of being computed."""

    logits: torch.Tensor
    cache: DynamicCache
    tokens: list
    reused_tokens: int


class KvCacheStore:
    """Moves a transformers model's KV cache to and from kvtier.

    `client` should be a never-raise `kvtier.Client` for serving (a failure is then a miss and the
    model recomputes); tests use `never_raise=False` to see errors. With a lossy `codec`, the first
    `lossless_sink_blocks` blocks of every context stay raw: they hold the attention sinks, and
    keeping one block raw cut the KL of nvfp4+had by a third on a real model (see the README).
    """

    def __init__(
        self,
        client,
        model,
        *,
        tenant="default",
        model_id=None,
        salt=b"",
        block_tokens=16,
        codec="raw",
        lossless_sink_blocks=1,
    ):
        if not isinstance(client, Client):
            raise TypeError("client must be a kvtier.Client")
        cfg = model.config
        self.client = client
        self.model = model
        self.layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype = model.dtype
        # KV moves through host memory: blocks are built on the CPU and rebuilt caches are put
        # on the model's device.
        self.device = next(model.parameters()).device
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype}: fp32, bf16 or fp16")
        self.block_tokens = block_tokens
        self.ns = Namespace(
            tenant,
            model_id or model_fingerprint(model),
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=_DTYPES[self.dtype],
            block_tokens=block_tokens,
            salt=salt,
            codec=codec,
            lossless_sink_blocks=lossless_sink_blocks,
        )
        self._kw = _cache_kwarg(model)

    # ---- layout: DynamicCache <-> kvtier blocks -------------------------------------------------

    def _layer_kv(self, cache, layer):
        lay = cache.layers[layer]
        have = cache.get_seq_length()
        if lay.keys is None or lay.keys.shape[-2] != have:
            raise ValueError(
                f"layer {layer} holds {None if lay.keys is None else lay.keys.shape[-2]} tokens of {have}: "
                "sliding-window and hybrid caches are not supported"
            )
        return lay.keys, lay.values

    def _host_tensor(self, numel):
        """A new 1-D CPU tensor of `numel` elements of the KV dtype. It lives in a kvtier shared
        buffer (`Client.alloc_buffer`), so loads into it and stores from it go through the
        server's same-node socket, one copy by the server, unless that path has been seen not to
        work for this client (another host, no socket): then plain memory, over TCP as before."""
        st = self.client.samenode_stats()
        if numel == 0 or (st["fallbacks"] and not st["active"]):
            return torch.empty(numel, dtype=self.dtype)
        return torch.frombuffer(self.client.alloc_buffer(numel * self.dtype.itemsize), dtype=self.dtype)

    def cache_to_blocks(self, cache, start, end, *, tail=False):
        """KV of tokens [start, end) as kvtier blocks back to back (a new contiguous tensor):
        full blocks of `block_tokens`, then, with `tail=True`, the partial last block."""
        bt, L, H, D = self.block_tokens, self.layers, self.kv_heads, self.head_dim
        n = (end - start) // bt
        t = (end - start) - n * bt if tail else 0
        # Without a tail the blocks are the result: built in a shared buffer (see `_host_tensor`).
        full = (
            torch.empty((n, L, 2, bt, H, D), dtype=self.dtype)
            if t
            else self._host_tensor(n * L * 2 * bt * H * D).view(n, L, 2, bt, H, D)
        )
        rest = torch.empty((L, 2, t, H, D), dtype=self.dtype)
        for layer in range(L):
            for kv, x in enumerate(self._layer_kv(cache, layer)):
                x = x[0]  # [H, S, D], batch 1
                if n:
                    seg = x[:, start : start + n * bt, :].reshape(H, n, bt, D)
                    full[:, layer, kv] = seg.permute(1, 2, 0, 3)
                if t:
                    rest[layer, kv] = x[:, start + n * bt : start + n * bt + t, :].permute(1, 0, 2)
        return torch.cat([full.reshape(-1), rest.reshape(-1)]) if t else full.reshape(-1)

    def blocks_to_cache(self, flat, tokens, cache=None, *, keep=None):
        """A `DynamicCache` (or `cache` extended) from `flat`, kvtier blocks back to back holding
        `tokens` tokens (full blocks, then a partial tail block if `tokens` is not a multiple of
        the block size), cut to its first `keep` tokens if given."""
        bt, L, H, D = self.block_tokens, self.layers, self.kv_heads, self.head_dim
        n, t = divmod(tokens, bt)
        per_token = L * 2 * H * D
        full = flat[: n * bt * per_token].view(n, L, 2, bt, H, D)
        rest = flat[n * bt * per_token : tokens * per_token].view(L, 2, t, H, D)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        for layer in range(L):
            kv = []
            for i in range(2):
                x = full[:, layer, i].permute(2, 0, 1, 3).reshape(H, n * bt, D)
                if t:
                    x = torch.cat([x, rest[layer, i].permute(1, 0, 2)], dim=1)
                if keep is not None and keep < tokens:
                    x = x[:, :keep]
                kv.append(x.unsqueeze(0).to(self.device))
            cache.update(kv[0], kv[1], layer)
        return cache

    # ---- prefix cache ---------------------------------------------------------------------------

    def lookup(self, tokens):
        """Leading tokens of `tokens` kvtier can give back."""
        return self.client.lookup(self.ns, list(tokens))

    def load(self, tokens, *, max_tokens=None):
        """`(cache, n)`: a cache rebuilt from the longest stored prefix of `tokens`, cut to `n`
        tokens (at most `max_tokens`), or `(None, 0)` on a miss."""
        cache, n, _ = self._load(tokens, max_tokens)
        return cache, n

    def _load(self, tokens, max_tokens):
        """`(cache, n, got)`: as `load`, with `got` the tokens of whole blocks that came back."""
        tokens = list(tokens)
        bt = self.block_tokens
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        # Whole blocks covering `limit` tokens, as far as `tokens` has whole blocks.
        want = min(-(-limit // bt), len(tokens) // bt) * bt
        if want <= 0:
            return None, 0, 0
        # A fresh buffer per load: the rebuilt cache may keep views of it.
        buf = self._host_tensor(want * self.ns.token_bytes // self.dtype.itemsize)
        got = self.client.load_into(self.ns, tokens[:want], buf)
        n = min(got, limit)
        if n <= 0:
            return None, 0, 0
        # `got` tokens of whole blocks came back; the cache keeps the first `n`.
        return self.blocks_to_cache(buf, got, keep=n), n, got

    def store(self, tokens, cache, *, first_token=0):
        """Stores the full blocks of `tokens` whose KV `cache` holds, from the block holding
        `first_token` on (blocks before it are already in kvtier). Returns blocks stored."""
        tokens = list(tokens)
        have = min(len(tokens), cache.get_seq_length())
        first_block = first_token // self.block_tokens
        start = first_block * self.block_tokens
        if have - start < self.block_tokens:
            return 0
        kv = self.cache_to_blocks(cache, start, have)
        return self.client.store(self.ns, tokens[:have], kv, first_block=first_block)

    def forward(self, ids, cache):
        """Runs the model on `ids` after what `cache` holds; the last position's logits."""
        with torch.no_grad():
            ids = torch.tensor([ids], device=self.device)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._kw: cache})
        return out.logits[0, -1].float()

    def prefill(self, tokens, *, reuse=True, store=True):
        """Prefills `tokens`, reusing kvtier's longest stored prefix (all but the last token at
        most) and storing the blocks it computed."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("empty prompt")
        cache, n, got = self._load(tokens, len(tokens) - 1) if reuse else (None, 0, 0)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        logits = self.forward(tokens[n:], cache)
        if store:
            # The `got` tokens of whole blocks that came back are in kvtier already.
            self.store(tokens, cache, first_token=got)
        return Step(logits=logits, cache=cache, tokens=tokens, reused_tokens=n)

    def greedy(self, step, count):
        """Greedy-decodes `count` tokens after a prefill: `(tokens, logits)` where `logits[i]` is
        the distribution token `i` was chosen from. The cache grows by `count - 1` tokens."""
        out, logits = [], [step.logits]
        for i in range(count):
            nxt = int(torch.argmax(logits[-1]))
            out.append(nxt)
            if i + 1 < count:
                logits.append(self.forward([nxt], step.cache))
        step.tokens = step.tokens + out[:-1]
        return out, torch.stack(logits)

    # ---- agent sessions -------------------------------------------------------------------------

    def park(self, session_id, tokens, cache, *, ttl_s=None, priority=None):
        """Parks a session: every token whose KV `cache` holds (the tail block included)."""
        tokens = list(tokens)[: cache.get_seq_length()]
        kv = self.cache_to_blocks(cache, 0, len(tokens), tail=True)
        return self.client.park(self.ns, session_id, tokens, kv, ttl_s=ttl_s, priority=priority)

    def extend(self, session_id, info, tokens, cache):
        """Extends a parked session (`info` as park/extend/resume returned it) with the tokens
        `cache` now holds beyond it; only the blocks from the old tail on are sent."""
        tokens = list(tokens)[: cache.get_seq_length()]
        prev = info["token_count"]
        start = prev - prev % self.block_tokens
        kv = self.cache_to_blocks(cache, start, len(tokens), tail=True)
        return self.client.extend(self.ns, session_id, info["version"], prev, tokens, kv)

    def resume(self, session_id):
        """`(info, cache)` of a parked session, or `(None, None)` on a miss."""
        got = self.client.resume(self.ns, session_id)
        if got is None:
            return None, None
        info, kv = got
        flat = torch.frombuffer(kv, dtype=self.dtype) if len(kv) else torch.empty(0, dtype=self.dtype)
        return info, self.blocks_to_cache(flat, info["token_count"])

    def continue_session(self, cache, tokens, *, reused):
        """Prefills `tokens[reused:]` after a resumed `cache` (which holds `tokens[:reused]`)."""
        tokens = list(tokens)
        if reused >= len(tokens):
            raise ValueError("nothing new to prefill: a turn adds at least one token")
        logits = self.forward(tokens[reused:], cache)
        return Step(logits=logits, cache=cache, tokens=tokens, reused_tokens=reused)
