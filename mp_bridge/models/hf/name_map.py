"""The one name map between our parameters and a LLaVA checkpoint, read both ways.

Each of our full (single-process) parameters is one :class:`HFMapping`: its name, the HF
tensors it is made of and how their rows stack into ours, as *runs* of contiguous rows
(``(our_row, hf_name, hf_row, length)`` along dim 0). ``load_hf`` reads, for the rows a
rank holds, only the intersecting runs (safetensors ``get_slice``); ``save_hf`` and the
checkpoint export cut a full tensor back into its HF tensors by the same runs. Kinds:

- direct (norms, biases, embeddings, ``proj`` / ``fc2`` / ``o_proj`` weights): one run;
- ``qkv``: megatron's per-K/V-group interleave ``[hk, (g·q, k, v), d]`` of HF's
  ``q_proj`` / ``k_proj`` / ``v_proj`` (g = heads / kv heads), weight or bias;
- ``[gate; up]``: SwiGLU's ``gate_proj`` rows then ``up_proj`` rows;
- the patch embedding: HF's conv weight ``[h, C, p, p]`` is our linear ``[h, C·p·p]``
  (``reshape``; never sharded).

Example (hq 4, hk 2, d 2, so g 2): our qkv rows ``0..3`` are q rows ``0..3`` (heads 0-1),
rows ``4..5`` k rows ``0..1``, ``6..7`` v rows ``0..1``, rows ``8..11`` q rows ``4..7`` ...

Names on disk are what transformers 5.x ``save_pretrained`` writes (``language_model.
model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``, ``multi_modal_projector.*``);
its modules are named ``model.language_model.*``, ``lm_head.weight``, ``model.vision_tower.*``,
``model.multi_modal_projector.*`` (:func:`disk_to_module` / :func:`module_to_disk`).
Tensors the LLaVA forward never reads (vision layers after the feature layer,
``post_layernorm``, SigLIP's ``head.*``) are :func:`untrained` keys: held, written back.
"""

from __future__ import annotations

from dataclasses import dataclass

from mp_bridge.models.data.config import MimoConfig

__all__ = ["HFMapping", "disk_to_module", "hf_mappings", "module_to_disk", "untrained"]

_V, _L = "vision_tower.", "language_model.model."
_DISK_TO_MODULE = (
    ("language_model.lm_head.", "lm_head."),
    (_L, "model.language_model."),
    (_V, "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def disk_to_module(name: str) -> str:
    """The ``named_parameters()`` name of an on-disk key (e.g. ``language_model.model.norm.
    weight`` -> ``model.language_model.norm.weight``)."""
    for disk, module in _DISK_TO_MODULE:
        if name.startswith(disk):
            return module + name[len(disk) :]
    return name


def module_to_disk(name: str) -> str:
    """Inverse of :func:`disk_to_module`."""
    for disk, module in _DISK_TO_MODULE:
        if name.startswith(module):
            return disk + name[len(module) :]
    return name


@dataclass(frozen=True)
class HFMapping:
    """Our parameter ``ours`` = the HF tensors ``hf`` (shapes ``hf_shapes``), stacked
    along dim 0 as ``runs`` ``(our_row, hf_index, hf_row, length)``; ``reshape``: our
    full shape when it differs from the one HF tensor's (the patch embedding)."""

    ours: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    runs: tuple[tuple[int, int, int, int], ...]
    reshape: tuple[int, ...] | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Our full (unpadded, single-process) tensor's shape."""
        if self.reshape is not None:
            return tuple(self.reshape)
        return (sum(n for _, _, _, n in self.runs), *self.hf_shapes[0][1:])

    def runs_in(self, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """The runs cut to our rows ``[start, stop)``: ``(our_row, hf_index, hf_row, n)``."""
        out = []
        for o, i, h, n in self.runs:
            a, b = max(o, start), min(o + n, stop)
            if a < b:
                out.append((a, i, h + a - o, b - a))
        return out


def _direct(ours: str, hf: str, shape: tuple[int, ...]) -> HFMapping:
    return HFMapping(ours, (hf,), (shape,), ((0, 0, 0, shape[0]),))


def _qkv(ours: str, prefix: str, heads: int, kv: int, d: int, rest: tuple[int, ...]):
    g = heads // kv
    names = tuple(f"{prefix}.{p}_proj.{ours.rsplit('.', 1)[1]}" for p in "qkv")
    shapes = ((heads * d, *rest), (kv * d, *rest), (kv * d, *rest))
    runs, row = [], 0
    for j in range(kv):
        for index, hf_row in ((0, j * g * d), (1, j * d), (2, j * d)):
            n = g * d if index == 0 else d
            runs.append((row, index, hf_row, n))
            row += n
    return HFMapping(ours, names, shapes, tuple(runs))


def _stacked(ours: str, names: tuple[str, str], shape: tuple[int, ...]) -> HFMapping:
    n = shape[0]
    return HFMapping(ours, names, (shape, shape), ((0, 0, 0, n), (n, 1, 0, n)))


def _block(
    m: list,
    ours: str,
    hf: str,
    hidden: int,
    heads: int,
    kv: int,
    ffn: int,
    *,
    vision: bool,
    qkv_bias: bool,
    bias: bool,
    norm_bias: bool,
) -> None:
    d = hidden // heads
    ln1, ln2 = (
        ("layer_norm1", "layer_norm2")
        if vision
        else ("input_layernorm", "post_attention_layernorm")
    )
    out = "out_proj" if vision else "o_proj"
    for our_ln, hf_ln in (("ln1", ln1), ("ln2", ln2)):
        m.append(_direct(f"{ours}.{our_ln}.weight", f"{hf}.{hf_ln}.weight", (hidden,)))
        if norm_bias:
            m.append(_direct(f"{ours}.{our_ln}.bias", f"{hf}.{hf_ln}.bias", (hidden,)))
    m.append(_qkv(f"{ours}.attn.qkv.weight", f"{hf}.self_attn", heads, kv, d, (hidden,)))
    if qkv_bias:
        m.append(_qkv(f"{ours}.attn.qkv.bias", f"{hf}.self_attn", heads, kv, d, ()))
    m.append(_direct(f"{ours}.attn.proj.weight", f"{hf}.self_attn.{out}.weight", (hidden, hidden)))
    if bias:
        m.append(_direct(f"{ours}.attn.proj.bias", f"{hf}.self_attn.{out}.bias", (hidden,)))
    if vision:
        for fc, shape in (("fc1", (ffn, hidden)), ("fc2", (hidden, ffn))):
            m.append(_direct(f"{ours}.mlp.{fc}.weight", f"{hf}.mlp.{fc}.weight", shape))
            m.append(_direct(f"{ours}.mlp.{fc}.bias", f"{hf}.mlp.{fc}.bias", shape[:1]))
    else:
        gate_up = (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight")
        m.append(_stacked(f"{ours}.mlp.fc1.weight", gate_up, (ffn, hidden)))
        m.append(_direct(f"{ours}.mlp.fc2.weight", f"{hf}.mlp.down_proj.weight", (hidden, ffn)))


def hf_mappings(cfg: MimoConfig, *, prefixes: dict[str, str] | None = None) -> list[HFMapping]:
    """Every parameter of a model of ``cfg`` (built by :func:`config_from_hf`) and its
    on-disk HF tensors. ``prefixes`` renames our three parts (default ``encoder``,
    ``projection``, ``llm``: :class:`ReferenceMimo`'s names)."""
    p = {"encoder": "encoder", "projection": "projection", "llm": "llm", **(prefixes or {})}
    e, h = p["encoder"], cfg.enc_hidden
    m: list[HFMapping] = []
    conv = (h, cfg.image_channels, cfg.patch_size, cfg.patch_size)
    patch = f"{_V}embeddings.patch_embedding"
    m.append(
        HFMapping(
            f"{e}.patch_embed.weight",
            (f"{patch}.weight",),
            (conv,),
            ((0, 0, 0, h),),
            reshape=(h, cfg.patch_dim),
        )
    )
    if cfg.enc_patch_bias:
        m.append(_direct(f"{e}.patch_embed.bias", f"{patch}.bias", (h,)))
    if cfg.enc_class_token:
        m.append(_direct(f"{e}.class_token", f"{_V}embeddings.class_embedding", (h,)))
    if cfg.enc_positions:
        m.append(
            _direct(
                f"{e}.position_embedding",
                f"{_V}embeddings.position_embedding.weight",
                (cfg.encoder_positions, h),
            )
        )
    if cfg.enc_pre_norm:
        for w in ("weight", "bias"):
            m.append(_direct(f"{e}.pre_norm.{w}", f"{_V}pre_layrnorm.{w}", (h,)))
    for i in range(cfg.enc_layers):
        _block(
            m,
            f"{e}.blocks.{i}",
            f"{_V}encoder.layers.{i}",
            h,
            cfg.enc_heads,
            cfg.enc_heads,
            cfg.enc_ffn,
            vision=True,
            qkv_bias=True,
            bias=True,
            norm_bias=True,
        )
    pr, proj = p["projection"], "multi_modal_projector"
    for ours, hf, shape in (
        ("fc1", "linear_1", (cfg.proj_hidden, h)),
        ("fc2", "linear_2", (cfg.llm_hidden, cfg.proj_hidden)),
    ):
        m.append(_direct(f"{pr}.{ours}.weight", f"{proj}.{hf}.weight", shape))
        if cfg.proj_bias:
            m.append(_direct(f"{pr}.{ours}.bias", f"{proj}.{hf}.bias", shape[:1]))
    lm, hl = p["llm"], cfg.llm_hidden
    m.append(_direct(f"{lm}.embed.weight", f"{_L}embed_tokens.weight", (cfg.vocab_size, hl)))
    for i in range(cfg.llm_layers):
        _block(
            m,
            f"{lm}.blocks.{i}",
            f"{_L}layers.{i}",
            hl,
            cfg.llm_heads,
            cfg.kv_heads,
            cfg.llm_ffn,
            vision=False,
            qkv_bias=cfg.llm_qkv_bias,
            bias=False,
            norm_bias=False,
        )
    m.append(_direct(f"{lm}.norm.weight", f"{_L}norm.weight", (hl,)))
    if not cfg.tie_embeddings:
        m.append(
            _direct(f"{lm}.head.weight", "language_model.lm_head.weight", (cfg.vocab_size, hl))
        )
    return m


def untrained(key: str, cfg: MimoConfig) -> bool:
    """True for an on-disk key the LLaVA forward never reads: a vision layer at or past
    ``cfg.enc_layers`` (the layers run), ``post_layernorm`` or SigLIP's ``head``."""
    rest = key[len(_V) :] if key.startswith(_V) else None
    if rest is None:
        return False
    if rest.startswith(("post_layernorm.", "head.")):
        return True
    if rest.startswith("encoder.layers."):
        layer = rest.split(".")[2]
        return layer.isdigit() and int(layer) >= cfg.enc_layers
    return False
