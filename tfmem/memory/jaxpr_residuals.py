"""Where a JAX trace's residuals come from: what a compiler may make again, and what it keeps.

`gradient_trace.trace_call_jax` reads the residuals `jax.vjp` saves; `origins` says, from the
same jaxpr (its nested jits inlined), which of them cheap element-wise ops make from the
others, which are masks compared from random bits, and which an element-wise op reads
broadcast to a larger size. `xla_rules` decides what a target holds for each.
"""

from __future__ import annotations

import dataclasses
import math

# XLA's cheap element-wise ops, which it fuses into (and duplicates for) every op that reads
# their result; a float division and the transcendental functions are not among them.
_ELEMENT_WISE = frozenset({
    "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "select_n", "clamp",
    "integer_pow", "square", "floor", "ceil", "round", "convert_element_type",
    "bitcast_convert_type", "copy", "copy_p", "lt", "le", "gt", "ge", "eq", "ne", "and",
    "or", "not", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic"})
# The other element-wise ops, which XLA does not make twice.
_EXPENSIVE_ELEMENT_WISE = frozenset({
    "div", "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erfc", "erf_inv",
    "pow", "sqrt", "rsqrt", "cbrt", "sin", "cos", "tan", "atan2"})
# Ops that read a tensor whole, from a buffer: a residual they read is materialized.
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
# What reads a tensor whole that another op reads too (`TracedCall.read_whole`): a library's
# contraction, or a reduction whose fusion writes the operand out for its other readers.
_READ_WHOLE = _CONTRACTIONS | frozenset({"reduce_sum", "reduce_max", "reduce_min",
                                         "reduce_prod", "argmax", "argmin"})
# Equations that run a nested jaxpr once, on their own arguments.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint", "remat"})
# How many ops back a residual's element-wise recipe is followed.
_DEPTH = 12


@dataclasses.dataclass(frozen=True)
class _Value:
    """A variable of a jaxpr with its nested jits inlined: `scope` tells apart the calls of
    one inner jaxpr."""

    scope: int
    ident: int
    shape: tuple
    dtype: str
    itemsize: int


def _flat_equations(jaxpr):
    """`(producers, readers, top)` of `jaxpr` with its nested jits inlined: the primitive,
    the input values (None: a literal) and the position of the equation that makes each
    value; `(primitive, output values)` of each equation that reads it; the values of the
    outer variables that a nested jit returns."""
    producers, readers, scopes = {}, {}, [0]

    def visit(inner, scope, outer):
        def value(var):
            if type(var).__name__ == "Literal":
                return None
            if id(var) in outer:
                return outer[id(var)]
            return _value(scope, var)

        for eqn in inner.eqns:
            nested = _nested_jaxpr(eqn)
            inputs = [value(v) for v in eqn.invars]
            if nested is not None:
                scopes[0] += 1
                mapping = {id(a): b for a, b in zip(nested.invars, inputs) if b is not None}
                results = visit(nested, scopes[0], mapping)
                for var, result in zip(eqn.outvars, results):
                    outer[id(var)] = result
                continue
            outputs = [value(v) for v in eqn.outvars]
            for item in inputs:
                if item is not None:
                    readers.setdefault(item, []).append((eqn.primitive.name, outputs))
            for item in outputs:
                producers[item] = (eqn.primitive.name, inputs, len(producers))
        return [value(v) for v in inner.outvars]

    outer: dict = {}
    visit(jaxpr, 0, outer)
    return producers, readers, outer


def _value(scope: int, var) -> _Value:
    aval = var.aval
    dtype = getattr(aval, "dtype", None)
    return _Value(scope, id(var), tuple(getattr(aval, "shape", ())), str(dtype),
                  getattr(dtype, "itemsize", 0))


def _nested_jaxpr(eqn):
    """The jaxpr a call equation (a nested jit, a custom derivative's call) runs, taking
    and returning what the equation does; None for a primitive (a loop's body, which runs
    on slices, included)."""
    if eqn.primitive.name not in _CALLS:
        return None
    for name in ("jaxpr", "call_jaxpr"):
        inner = eqn.params.get(name)
        inner = getattr(inner, "jaxpr", inner)
        if (hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars)
                and len(inner.outvars) == len(eqn.outvars)):
            return inner
    return None


def origins(jaxpr, residuals: dict,
            kept) -> tuple[frozenset, frozenset, dict, frozenset, dict, frozenset]:
    """Names of `residuals` (name -> variable) that are `TracedCall.derived` from the rest
    and from `kept` (the call's inputs and outputs the backward reads), of those that are
    `TracedCall.drawn`, `{name: bytes}` of those not made by a cheap element-wise op
    that an element-wise op reads beside larger tensors, at that op's size
    (`TracedCall.widened`), the names of those that are `TracedCall.fused`, and `{name:
    bytes}` of the others that element-wise ops make from a narrower tensor of their shape
    (a cast to float32 of a bfloat16 convolution's output), at that tensor's size
    (`TracedCall.narrowed`), and the names of those a contraction or a reduction reads,
    or a cast of them (`TracedCall.read_whole`)."""
    producers, readers, top = _flat_equations(jaxpr)

    def value_of(var):
        return top.get(id(var)) or _value(0, var)

    values = {name: value_of(var) for name, var in residuals.items()}
    kept_values = {value_of(var) for var in kept}
    recipes = _Recipes(producers)
    # The latest first: each is made again from what was made before it.
    made = sorted((name for name in values if values[name] in producers),
                  key=lambda n: -producers[values[n]][2])
    derived, drawn, _ = recipes.made_again(made, values, kept_values, readers)
    fused, _, narrowed = recipes.made_again(made, values, kept_values, readers, fusing=True)
    widened = {}
    for name, value in values.items():
        sizes = [math.prod(out.shape) * out.itemsize
                 for primitive, outputs in readers.get(value, ())
                 if primitive in _ELEMENT_WISE or primitive in _EXPENSIVE_ELEMENT_WISE
                 for out in outputs if math.prod(out.shape) > math.prod(value.shape)]
        made_by = producers.get(value, ("",))[0]
        if sizes and name not in derived and made_by not in _ELEMENT_WISE:
            widened[name] = max(sizes)
    read_whole = frozenset(name for name, value in values.items()
                           if _read_whole(value, readers, _DEPTH))
    return frozenset(derived), frozenset(drawn), widened, frozenset(fused), narrowed, read_whole


def _read_whole(value, readers, depth) -> bool:
    """Whether a contraction or a reduction reads `value`, or a cast of it (a bfloat16
    tensor a mean reads in float32): the cast is fused into that read, from `value`."""
    for primitive, outputs in readers.get(value, ()):
        if primitive in _READ_WHOLE:
            return True
        if primitive == "convert_element_type" and depth and any(
                _read_whole(output, readers, depth - 1) for output in outputs):
            return True
    return False


class _Recipes:
    """What element-wise ops make a residual from, over one flattened jaxpr's `producers`."""

    def __init__(self, producers: dict):
        self.producers = producers
        self.held: set = set()
        self.random: dict = {}

    def made_again(self, made, values, kept_values, readers, fusing=False):
        """`(made again, drawn, {name: narrower bytes})` among the residuals `made` (latest
        first): made again by cheap element-wise ops, none a contraction reads; `fusing`:
        by element-wise ops of any cost, from smaller tensors too, whatever reads them."""
        self.held = set(values.values()) | kept_values
        again, drawn, narrowed = set(), set(), {}
        for name in made:
            value = values[name]
            if not fusing and {primitive for primitive, _ in readers.get(value, ())
                               } & _CONTRACTIONS:
                continue
            mask = value.dtype == "bool"
            if mask and self.from_random_bits(value, _DEPTH):
                drawn.add(name)
                continue
            self.held.discard(value)
            if self.derivable(value, value.shape, mask, _DEPTH, {}, fusing):
                again.add(name)
                continue
            self.held.add(value)
            narrow = self.narrowest(value, _DEPTH) if fusing else 0
            if narrow and narrow < math.prod(value.shape) * value.itemsize:
                narrowed[name] = narrow
        return again, drawn, narrowed

    def derivable(self, value, shape, mask, depth, seen, fusing=False) -> bool:
        """Whether cheap element-wise ops make `value` from held tensors of `shape`
        (`fusing`: any element-wise op, from held tensors and anything smaller)."""
        if value is None or not value.shape:  # a literal or a scalar
            return True
        if fusing and math.prod(value.shape) < math.prod(shape):
            return True  # a smaller tensor (a normalization's statistics), broadcast
        if value in self.held:
            return value.shape == shape
        found = self.producers.get(value)
        if found is None or depth == 0:
            return False
        if value not in seen:
            primitive, inputs, _ = found
            smaller = all(v is None or math.prod(v.shape) < math.prod(value.shape)
                          for v in inputs)
            if primitive == "broadcast_in_dim" and (mask or (fusing and smaller) or all(
                    v is None or not v.shape for v in inputs)):
                seen[value] = True  # a scalar, or for a mask a smaller tensor, broadcast
            else:
                ops = _ELEMENT_WISE | _EXPENSIVE_ELEMENT_WISE if fusing else _ELEMENT_WISE
                seen[value] = (primitive in ops and value.shape == shape
                               and all(self.derivable(v, shape, mask, depth - 1, seen, fusing)
                                       for v in inputs))
        return seen[value]

    def from_random_bits(self, value, depth) -> bool:
        found = self.producers.get(value) if value is not None else None
        if found is None or depth == 0:
            return False
        if value not in self.random:
            self.random[value] = found[0] == "random_bits" or (
                found[0] in _ELEMENT_WISE and any(self.from_random_bits(v, depth - 1)
                                                  for v in found[1]))
        return self.random[value]

    def narrowest(self, value, depth) -> int:
        """The fewest bytes among `value` and what element-wise ops make it from (beside
        smaller tensors broadcast), following the operand of its own shape."""
        nbytes = math.prod(value.shape) * value.itemsize
        found = self.producers.get(value)
        ops = _ELEMENT_WISE | _EXPENSIVE_ELEMENT_WISE
        if found is None or depth == 0 or found[0] not in ops:
            return nbytes
        operands = [v for v in found[1] if v is not None and v.shape == value.shape]
        if len(operands) != 1 or any(v is not None and math.prod(v.shape) >= math.prod(
                value.shape) and v.shape != value.shape for v in found[1]):
            return nbytes
        return min(nbytes, self.narrowest(operands[0], depth - 1))
