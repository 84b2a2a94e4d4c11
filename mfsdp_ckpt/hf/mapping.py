"""The mapping language of the Hugging Face bridge: declarative rules between canonical keys
(Megatron-Core TE names, without the ``model.`` prefix) and HF hub keys.

An architecture is a list of :class:`Rule` templates. ``{i}`` in a template is the layer index,
``{e}`` the *global* expert index, ``{k}`` the depth of a multi-token-prediction (MTP) layer and,
in HF templates, ``{n}`` the HF layer index of MTP depth k (``num_layers + k``: DeepSeek stores
its MTP layers after the decoder's). A rule applies only when its ``when`` predicate holds for the
model config, and a layer rule only on the layers its ``layers`` predicate picks (dense or MoE
layers, attention or linear-attention layers). Layer rules apply to the MTP layers' transformer
layers too when the architecture names where those live (``Architecture.mtp_layer``). Each rule
kind knows how one canonical tensor becomes its HF tensors and back:

* :class:`Direct` — the same tensor under another name;
* :class:`Replicated` — one tensor stored several times by HF (DeepSeek's MTP layers repeat the
  embedding and the output head): written to every name, read from the first and checked
  equal to the others;
* :class:`FusedQKV` — ``linear_qkv.{weight,bias}``, rows laid out per query group (the group's
  q heads, then its k head, then its v head) ⇄ ``q_proj`` / ``k_proj`` / ``v_proj`` (head-major);
* :class:`GatedMLP` — ``linear_fc1.weight = [gate; up]`` ⇄ ``gate_proj`` / ``up_proj``
  (also Mixtral's ``w1`` / ``w3`` and shared experts).

Architecture modules may add rule kinds of their own (e.g. Qwen3-Next's gated attention and
gated DeltaNet projections).

:func:`expand` turns the templates into concrete :class:`Conversion` s for one config and checks
that no canonical key and no HF key is produced twice, so that every export / import consumes
each source tensor once and writes each target once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from mfsdp_ckpt.errors import ConversionError
from mfsdp_ckpt.format.keys import model_key
from mfsdp_ckpt.model.shape import ModelShape, ShapeModel, meta_model

__all__ = [
    "Predicate",
    "Rule",
    "Direct",
    "Replicated",
    "FusedQKV",
    "GatedMLP",
    "Conversion",
    "Architecture",
    "expand",
    "dense",
    "moe",
    "untied",
    "qk_norm",
    "qkv_bias",
    "shared_expert",
    "moe_layer",
    "dense_layer",
    "attention_layer",
    "linear_attention_layer",
    "LAYER",
    "HF_LAYER",
    "expand_theirs",
    "mtp_prefixes",
    "canonical_shapes",
    "check_against",
    "count_their_keys",
    "indices_held",
]

Predicate = Callable[[ModelShape], bool]
#: which layers (0-based; MTP layers count on from ``num_layers``) a layer rule applies to
LayerPredicate = Callable[[ModelShape, int], bool]

#: the canonical prefix of decoder layer ``{i}``, and the HF one of the Llama family
LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."


def always(_: ModelShape) -> bool:
    return True


def dense(c: ModelShape) -> bool:
    return c.num_experts == 0


def moe(c: ModelShape) -> bool:
    return c.num_experts > 0


def untied(c: ModelShape) -> bool:
    return not c.tie_embeddings


def qk_norm(c: ModelShape) -> bool:
    return c.qk_layernorm


def qkv_bias(c: ModelShape) -> bool:
    return c.add_qkv_bias


def shared_expert(c: ModelShape) -> bool:
    return c.num_experts > 0 and c.moe_shared_expert_ffn_hidden_size > 0


def moe_layer(c: ModelShape, layer: int) -> bool:
    return c.is_moe_layer(layer)


def dense_layer(c: ModelShape, layer: int) -> bool:
    return not c.is_moe_layer(layer)


def attention_layer(c: ModelShape, layer: int) -> bool:
    return c.layer_kind(layer) == "attention"


def linear_attention_layer(c: ModelShape, layer: int) -> bool:
    return c.layer_kind(layer) == "linear_attention"


@dataclass(frozen=True)
class Rule:
    """One canonical key template ⇄ one or more HF key templates (see the module docstring)."""

    ours: str
    theirs: tuple[str, ...] | str
    when: Predicate = field(default=always, compare=False)
    layers: LayerPredicate | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.theirs, str):
            object.__setattr__(self, "theirs", (self.theirs,))

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        """The shapes of the HF tensors made from a canonical tensor of ``shape``."""
        raise NotImplementedError

    def views(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor] | None:
        """The HF tensors as views of the (contiguous) canonical ``tensor``, in the order of
        ``theirs``: each holds its HF tensor's elements in row-major order, possibly strided and
        in more dimensions than the HF shape. The bridge writes them to a file, or reads a file
        into them, without copying (:mod:`mfsdp_ckpt.hf.strided_io`). None: this rule has no
        such views (it reorders elements); :meth:`split` and :meth:`merge` are used instead."""
        return None

    def split(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        """Canonical tensor -> the HF tensors, in the order of ``theirs`` (contiguous): the
        :meth:`views`, copied out, for the rules that have them."""
        views = self.views(tensor.contiguous(), c)
        if views is None:
            raise NotImplementedError
        return [v.contiguous().view(shape) for v, shape in zip(views, self.their_shapes(tensor.shape, c))]

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        """The HF tensors, in the order of ``theirs`` -> the canonical tensor (contiguous)."""
        raise NotImplementedError


class Direct(Rule):
    """The same tensor under another name."""

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        return [torch.Size(shape)]

    def views(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        return [tensor]

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        return tensors[0].contiguous()


class Replicated(Rule):
    """One tensor that HF stores under every name of ``theirs`` (a template with ``{n}`` stands
    for one name per MTP layer): written to each, read from the first and checked equal to the
    rest (a checkpoint whose copies differ cannot be one of our models)."""

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        return [torch.Size(shape)] * len(expand_theirs(self.theirs, c))

    # no views: an import reading every copy into one view would let the last win unchecked
    def split(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        return [tensor.contiguous()] * len(expand_theirs(self.theirs, c))

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        first = tensors[0]
        for n, other in enumerate(tensors[1:], 1):
            if not torch.equal(first, other):
                names = expand_theirs(self.theirs, c)
                raise ConversionError(
                    f"tensor {names[n]!r} differs from {names[0]!r}; this architecture stores one tensor under both names"
                )
        return first.contiguous()


class FusedQKV(Rule):
    """``linear_qkv`` (weight ``[groups*(per+2)*d, hidden]`` or bias ``[groups*(per+2)*d]``,
    per query group: ``per = heads/groups`` q heads, one k head, one v head) ⇄ q, k, v
    projections ``[heads*d, …]``, ``[groups*d, …]``, ``[groups*d, …]``. HF's query head h uses
    key/value head ``h // per``, the same grouping."""

    @staticmethod
    def _dims(c: ModelShape) -> tuple[int, int, int]:
        return c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.kv_channels

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        g, per, d = self._dims(c)
        rest = tuple(shape[1:])
        return [torch.Size((g * per * d, *rest)), torch.Size((g * d, *rest)), torch.Size((g * d, *rest))]

    def views(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        g, per, d = self._dims(c)
        grouped = tensor.view(g, per + 2, d, *tensor.shape[1:])
        return [grouped[:, :per], grouped[:, per], grouped[:, per + 1]]  # q [g, per, d, ...], k and v [g, d, ...]

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        g, per, d = self._dims(c)
        q, k, v = tensors
        rest = tuple(q.shape[1:])
        fused = torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
        return fused.reshape(g * (per + 2) * d, *rest).contiguous()


class GatedMLP(Rule):
    """``linear_fc1.weight = [gate; up]`` ``[2*ffn, hidden]`` ⇄ gate ``[ffn, hidden]``, up
    ``[ffn, hidden]``."""

    def their_shapes(self, shape: torch.Size, c: ModelShape) -> list[torch.Size]:
        half = torch.Size((shape[0] // 2, *shape[1:]))
        return [half, half]

    def views(self, tensor: torch.Tensor, c: ModelShape) -> list[torch.Tensor]:
        return list(tensor.chunk(2, dim=0))

    def merge(self, tensors: list[torch.Tensor], c: ModelShape) -> torch.Tensor:
        return torch.cat(tensors, dim=0).contiguous()


def expand_theirs(theirs: tuple[str, ...], c: ModelShape) -> tuple[str, ...]:
    """``theirs`` with every template holding ``{n}`` (outside an MTP rule) written once per MTP
    layer."""
    out: list[str] = []
    for t in theirs:
        out.extend(
            t.replace("{n}", str(c.num_layers + k)) for k in range(c.mtp_num_layers)
        ) if "{n}" in t else out.append(t)
    return tuple(out)


@dataclass(frozen=True)
class Conversion:
    """One rule at one layer / expert: canonical key ``ours`` (with the ``model.`` prefix) ⇄
    HF keys ``theirs``."""

    rule: Rule
    ours: str
    theirs: tuple[str, ...]


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: its rules (in HF's key order), its config translation both ways, and
    what of our model config it cannot express.

    ``unsupported(cfg)`` lists, one phrase each, what in ``cfg`` this architecture cannot
    represent (empty: it can). ``to_hf_config(cfg)`` gives the ``config.json`` dict (without
    dtype); ``from_hf_config(d, source)`` gives our config or raises :class:`ConversionError`
    naming every field it cannot express."""

    name: str
    model_type: str
    hf_class: str
    rules: tuple[Rule, ...]
    unsupported: Callable[[ModelShape], list[str]]
    to_hf_config: Callable[[ModelShape], dict]
    from_hf_config: Callable[[dict, str], ModelShape]
    #: the HF prefix of MTP depth ``{k}``'s transformer layer (``{n}``: its HF layer index); empty:
    #: this architecture maps no MTP layers
    mtp_layer: str = ""
    #: ``(regular expression, why)`` of HF tensors an import leaves out (e.g. released tensors of
    #: modules transformers' class does not have either), each named in the import's notes
    ignored: tuple[tuple[str, str], ...] = ()


def _fill(template: str, i: int | None, e: int | None, k: int | None, c: ModelShape) -> str:
    out = template.replace("{i}", str(i)).replace("{e}", str(e))
    if k is not None:
        out = out.replace("{k}", str(k)).replace("{n}", str(c.num_layers + k))
    return out


def _layer_slots(arch: Architecture, c: ModelShape) -> list[tuple[int, int | None]]:
    """``(layer index, MTP depth or None)`` of every layer the layer rules apply to."""
    slots: list[tuple[int, int | None]] = [(i, None) for i in range(c.num_layers)]
    if arch.mtp_layer:
        slots += [(c.num_layers + k, k) for k in range(c.mtp_num_layers)]
    return slots


def _at_layer(rule: Rule, arch: Architecture, k: int | None) -> tuple[str, tuple[str, ...]]:
    """A layer rule's templates for a decoder layer (``k`` None) or MTP depth ``k``'s layer."""
    if k is None:
        return rule.ours, rule.theirs
    theirs = tuple(t.replace(HF_LAYER, arch.mtp_layer) for t in rule.theirs)
    return rule.ours.replace(LAYER, "mtp.layers.{k}.transformer_layer."), theirs


def mtp_prefixes(arch: Architecture, c: ModelShape) -> set[str]:
    """The HF key prefixes under which MTP depth 0 of ``c`` lives in ``arch``'s files (its
    transformer layer's and its own tensors'): a directory holding no key under any of them has
    no MTP layer. Cheap (no expansion), so it may run before the counts are checked."""
    prefixes = {_fill(arch.mtp_layer, None, None, 0, c)} if arch.mtp_layer else set()
    for rule in arch.rules:
        if "{k}" in rule.ours:
            prefixes |= {_fill(t, None, None, 0, c) for t in rule.theirs}
    return prefixes


def expand(arch: Architecture, c: ModelShape) -> list[Conversion]:
    """The concrete conversions of ``arch`` for config ``c``, in HF key order (rules outside
    layers where they stand; a run of layer rules repeated per layer, decoder layers then MTP
    layers, expert rules per expert; MTP rules per MTP layer). Raises if two conversions share a
    canonical or an HF key (a broken mapping)."""
    out: list[Conversion] = []
    block: list[Rule] = []

    def emit(rule: Rule, ours: str, theirs: tuple[str, ...], i: int | None, k: int | None) -> None:
        experts = range(c.num_experts) if "{e}" in ours else [None]
        theirs = theirs if k is not None else expand_theirs(theirs, c)
        for e in experts:
            filled = tuple(_fill(t, i, e, k, c) for t in theirs)
            out.append(Conversion(rule, model_key(_fill(ours, i, e, k, c)), filled))

    def flush() -> None:
        for i, k in _layer_slots(arch, c):
            for rule in block:
                if rule.layers is None or rule.layers(c, i):
                    emit(rule, *_at_layer(rule, arch, k), i, k)
        block.clear()

    for rule in arch.rules:
        if not rule.when(c):
            continue
        if "{i}" in rule.ours:
            block.append(rule)
            continue
        flush()
        for k in range(c.mtp_num_layers) if "{k}" in rule.ours else [None]:
            emit(rule, rule.ours, rule.theirs, None, k)
    flush()
    seen_ours: set[str] = set()
    seen_theirs: set[str] = set()
    twice = []
    for conv in out:
        if conv.ours in seen_ours:
            twice.append(conv.ours)
        seen_ours.add(conv.ours)
        for t in conv.theirs:
            if t in seen_theirs:
                twice.append(t)
            seen_theirs.add(t)
    if twice:
        raise ConversionError(
            f"architecture '{arch.name}': mapping produces these keys more than once: {', '.join(twice)}"
        )
    return out


def count_their_keys(arch: Architecture, c: ModelShape) -> int:
    """How many HF keys :func:`expand` would produce for ``c``, by arithmetic alone: an import
    compares it with the tensors the files hold before expanding anything, so a config that
    declares a million layers costs nothing."""
    n = 0
    slots = _layer_slots(arch, c)
    for rule in arch.rules:
        if not rule.when(c):
            continue
        if "{i}" in rule.ours:
            layers = sum(1 for i, _ in slots if rule.layers is None or rule.layers(c, i))
        else:
            layers = c.mtp_num_layers if "{k}" in rule.ours else 1
        theirs = len(rule.theirs) if "{k}" in rule.ours or "{i}" in rule.ours else len(expand_theirs(rule.theirs, c))
        n += theirs * layers * (c.num_experts if "{e}" in rule.ours else 1)
    return n


def indices_held(arch: Architecture, c: ModelShape, keys: Iterable[str]) -> tuple[set[int], set[int]]:
    """The layer indices (``{i}``) and expert indices (``{e}``) that HF ``keys`` hold under the
    HF templates of ``arch``'s rules that apply to ``c``: what a directory's files can back of
    the layer and expert counts its config declares."""
    alternatives = []
    for n, template in enumerate(
        sorted({t for rule in arch.rules if rule.when(c) for t in rule.theirs if "{i}" in t or "{e}" in t})
    ):
        pattern = re.escape(template)
        pattern = pattern.replace(re.escape("{i}"), f"(?P<i{n}>[0-9]{{1,9}})").replace(
            re.escape("{e}"), f"(?P<e{n}>[0-9]{{1,9}})"
        )
        alternatives.append(f"(?:{pattern})")
    layers: set[int] = set()
    experts: set[int] = set()
    if not alternatives:
        return layers, experts
    regex = re.compile("|".join(alternatives))
    for key in keys:
        m = regex.fullmatch(key)
        if m is None:
            continue
        for name, value in m.groupdict().items():
            if value is not None:
                (layers if name[0] == "i" else experts).add(int(value))
    return layers, experts


def canonical_shapes(c: ModelShape, model: ShapeModel | None = None) -> dict[str, torch.Size]:
    """Every canonical model key (``model.<fqn>``) of the model of shape ``c`` and its tensor shape,
    from a model built on the meta device (``model.shape.meta_model``: no memory); ``model``: that
    model, if already built."""
    return {model_key(name): p.shape for name, p in (model or meta_model(c)).named_parameters()}


def check_against(
    conversions: list[Conversion], c: ModelShape, arch: Architecture, model: ShapeModel | None = None
) -> dict[str, torch.Size]:
    """Check that ``conversions`` cover every parameter of the model exactly (a mapping that
    misses or invents a parameter is a bug in the architecture module); returns the shapes.
    ``model``: the meta-device model of ``c``, if already built."""
    shapes = canonical_shapes(c, model)
    ours = {conv.ours for conv in conversions}
    missing, extra = sorted(set(shapes) - ours), sorted(ours - set(shapes))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no rule for {', '.join(missing)}")
        if extra:
            parts.append(f"rules for keys the model does not have: {', '.join(extra)}")
        raise ConversionError(f"architecture '{arch.name}' does not map this model config: {'; '.join(parts)}")
    return shapes
