"""The node-by-node walk of a functional graph that `saved_tensors` runs.

`Walker` visits each call in order, asks `layer_rules` first and `gradient_trace` otherwise,
and collects the kept tensors by identity, so that a tensor two calls keep counts once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import keras

from tfmem import _keras_internals as internals
from tfmem._sizes import itemsize
from tfmem.memory import gradient_trace, layer_rules, xla_rules
from tfmem.remat import segments
from tfmem.remat.graph import node_order, range_inputs


class UnknownSizeError(ValueError):
    """A tensor of the graph has a dimension beyond the batch that is not known (a model built
    on `keras.Input((None, None, 3))`): the planner cannot size it."""


def sample_bytes(shape, dtype) -> int:
    dims = tuple(shape)[1:]
    if any(d is None for d in dims):
        raise UnknownSizeError(
            f"A tensor of shape {tuple(shape)} has an unknown size beyond the batch dimension. "
            "The planner needs concrete shapes: build the model with a concrete input shape, "
            "e.g. `keras.Input((224, 224, 3))` instead of `(None, None, 3)`."
        )
    return math.prod(dims) * itemsize(dtype)


# Traces by call configuration, shared by every plan in this process: a model planned again
# (the guard at each `fit`, the levers when nothing fits, several devices) is not retraced.
_TRACES: dict = {}
_MAX_TRACES = 4096
# A rule layer's transient over its largest tensor, by configuration (`Walker.rule_transient`).
_TRANSIENTS: dict = {}
# The widest last axis a rule layer's small copy is traced at, where the copy keeps its shape
# there too: a per-element or per-channel transient is the same multiple of the input at any
# width, and a reduction along that axis (softmax, layer norm) is then counted as at least
# 1/64 of the input, on the safe side. One trace serves every width above it.
_SMALL_LAST_AXIS = 64


class Walker:
    """Collects the kept tensors of one model, keyed so that a tensor counts once."""

    def __init__(self, compute_dtype: str | None, frozen: Collection[int],
                 trace_call: Callable, recomputed: Collection[int] = (),
                 ranges=(), inner_graphs: dict | None = None, target: str | None = None):
        # The device kind XLA compiles the step for (JAX; None: TensorFlow's graph, or no
        # device given): `xla_rules` adds what it keeps there.
        self.target = target
        self.fused: set = set()  # keys XLA recomputes from kept tensors (`xla_rules`)
        self.override = compute_dtype  # the plan's compute dtype for a float32-built model
        self.frozen = frozenset(frozen)  # ids of layers the plan treats as not trainable
        self.trace_call = trace_call  # the backend's half of gradient_trace
        self.context: tuple = ()  # the nested-model calls the walk is inside
        self.alias: dict = {}  # key -> key of the tensor whose buffer it shares
        self.sizes: dict = {}  # kept key -> bytes per sample
        # Kept keys XLA holds only up to a micro-batch (`keep_below`) -> that micro-batch.
        self.bounded: dict = {}
        self.layouts: dict = {}  # kept key -> (shape of a sample, itemsize), where known
        self.new_tensors = 0  # tensors kept that have no key of their own so far
        self.needs_grad: set = set()
        self.model_inputs: set = set()
        self.readers: dict = {}  # (context, id(tensor)) -> the calls that read it
        self.largest = 0  # outside the rematerialized ranges, bytes per sample
        self.largest_anywhere = 0  # inside them (the largest outside is `largest`)
        # The most a call's gradients hold at once, bytes per sample (`workspace`): a tensor's
        # gradient beside its producer's (`xla_rules.gradient_maps`: one where XLA fuses them).
        self.gradients = 0
        self.maps = xla_rules.gradient_maps(target)
        self.transient = 0  # the largest call's own transient, bytes per sample
        # Per call in forward order where the target frees what later calls keep before a
        # call's backward runs (`xla_rules`' "backward_in_order"): what is kept by then and
        # the call's own workspace, bytes per sample.
        self.backward_peaks: list[int] = []
        self.fixed_transient = 0  # the largest call's transient of a weight's size, bytes
        # What the largest grouped convolution's XLA call leaves in glibc's default heap,
        # bytes per sample, held through the step (`layer_rules`).
        self.heap_scratch = 0
        self.fallbacks: set[str] = set()
        self.traced: set[str] = set()
        self.loops: set[str] = set()
        self.recomputed = frozenset(recomputed)  # ids of layers rematerialized
        # Rematerialized ranges of node orders: "" the top-level graph's, a layer's path
        # ("name", "name/inner") that of the graph inside it (a nested model, or
        # `inner_graphs`' for a subclassed layer).
        self.ranges = {path: {start: stop for start, stop in spans} for path, spans in ranges}
        self.inner_graphs = inner_graphs or {}  # id(layer) -> the functional graph of its call
        self.path = ""  # the graph now walked
        self.node_paths: dict = {}  # id(node) -> its graph's path, in a flattened graph
        self.inner_peaks: list[int] = []  # per top-level call: the largest range inside it
        self.segments: list[tuple[str, int]] = []  # (name, bytes it keeps inside) per one
        # Per rematerialized range: what it keeps inside + the workspace of its own calls,
        # held together while it is recomputed (its calls' workspace is not the others').
        self.recompute_peaks: list[int] = []
        self.touched: set = set()  # keys kept by the call now walked
        self.node_keys: list[frozenset] = []  # keys each top-level call keeps, in order

    # -- keys and dtypes --------------------------------------------------------------------
    def key(self, tensor):
        raw = (self.context, id(tensor))
        return self.alias.get(raw, raw)

    def read_by_others(self, tensor) -> bool:
        """Whether a call besides the one walked reads `tensor` (in the graph walked)."""
        return self.readers.get((self.context, id(tensor)), 0) > 1

    def dtype_of(self, tensor) -> str:
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if self.override and dtype == "float32" and self.key(tensor) not in self.model_inputs:
            return self.override
        return dtype

    def compute_dtype(self, layer) -> str:
        dtype = keras.backend.standardize_dtype(getattr(layer, "compute_dtype", "float32"))
        return self.override if self.override and dtype == "float32" else dtype

    def is_frozen(self, layer) -> bool:
        return id(layer) in self.frozen

    def has_trainable(self, layer) -> bool:
        if not isinstance(layer, keras.layers.Layer) or self.is_frozen(layer):
            return False
        return any(id(w) not in self.frozen for w in layer.trainable_weights)

    # -- what is kept -----------------------------------------------------------------------
    def keep(self, tensor, dtype=None) -> None:
        """Keeps `tensor` (shared by identity) or, in another dtype, a new copy of it."""
        own = self.dtype_of(tensor)
        dtype = keras.backend.standardize_dtype(dtype) if dtype else own
        key = self.key(tensor) if dtype == own else (self.key(tensor), dtype)
        self.sizes[key] = sample_bytes(tensor.shape, dtype)
        self.layouts[key] = (tuple(tensor.shape)[1:], itemsize(dtype))
        self.touched.add(key)
        self.largest = max(self.largest, self.sizes[key])
        self.gradients = max(self.gradients, self.maps * self.sizes[key])

    def sample_bytes(self, tensor, dtype=None) -> int:
        return sample_bytes(tensor.shape, dtype or self.dtype_of(tensor))

    def keep_new(self, shape, dtype, kind: str = "new") -> None:
        nbytes = sample_bytes(shape, dtype)
        self.keep_bytes(nbytes, kind=kind, layout=(tuple(shape)[1:], itemsize(dtype)))
        self.largest = max(self.largest, nbytes)
        self.gradients = max(self.gradients, self.maps * nbytes)

    def keep_below(self, shape, dtype, micro_batch: int) -> None:
        """Keeps a new tensor that XLA holds only at micro-batches up to `micro_batch`."""
        self.keep_bytes(sample_bytes(shape, dtype), layout=(tuple(shape)[1:], itemsize(dtype)))
        self.bounded[("new", self.new_tensors)] = micro_batch

    def kept_bytes(self) -> int:
        """Bytes per sample kept at every micro-batch (not those of `keep_below`)."""
        return sum(nbytes for key, nbytes in self.sizes.items() if key not in self.bounded)

    def keep_drawn(self, shape, dtype) -> None:
        """Keeps a new tensor drawn from the layer's seed, not made from its inputs' values
        (a dropout's mask): recomputing it needs no input (`segments.GraphFacts`)."""
        self.keep_new(shape, dtype, kind="drawn")

    def keep_bytes(self, nbytes: int, kind: str = "new", layout=None) -> None:
        """Keeps a new tensor of `nbytes` a sample (`layout`: its sample shape and itemsize,
        where known)."""
        self.new_tensors += 1  # a count, not len(sizes): rematerialized layers remove keys
        key = (kind, self.new_tensors)
        self.sizes[key] = int(nbytes)
        if layout is not None:
            self.layouts[key] = layout
        self.touched.add(key)

    # -- the walk ---------------------------------------------------------------------------
    def walk(self, model) -> None:
        top = not self.context
        nodes = node_order(internals.functional_of(model))
        for node in nodes:
            for tensor in node.input_tensors:
                key = (self.context, id(tensor))
                self.readers[key] = self.readers.get(key, 0) + 1
        spans = self.ranges.get(self.path, {})
        taken = range_inputs(nodes, list(spans.items())) if spans else {}
        position = 0
        while position < len(nodes):
            stop = spans.get(position)
            if stop is not None:  # a rematerialized range of this graph
                self.recompute(nodes[position:stop + 1], taken[position][0])
                position = stop + 1
                continue
            if top:
                self.touched, segments_before = set(), len(self.segments)
            self.call(nodes[position])
            if top:
                # Less what ranges inside the call recomputed (popped from `sizes`).
                self.node_keys.append(frozenset(k for k in self.touched if k in self.sizes))
                self.inner_peaks.append(max((inside for _, inside in
                                             self.segments[segments_before:]), default=0))
            position += 1

    def recompute(self, nodes, inputs) -> None:
        """A rematerialized range: what it keeps inside is recomputed in the backward pass,
        one range at a time; only its `inputs` (`range_inputs`) are kept across the passes."""
        self.segments.append((self.range_name(nodes),
                              self._recomputed(nodes, inputs, self.call)))

    def range_name(self, nodes) -> str:
        """`first…last` of a range, each prefixed by the path of the graph it comes from
        (`node_paths`, else the graph walked): `up4_dense:bn0…concatenate`."""
        (first, first_path), (last, last_path) = (
            (node.operation.name, self.node_paths.get(id(node), self.path))
            for node in (nodes[0], nodes[-1]))
        if first_path != last_path:
            return (f"{first_path}:{first}" if first_path else first) + "…" + (
                f"{last_path}:{last}" if last_path else last)
        name = first if first == last else f"{first}…{last}"
        return f"{first_path}:{name}" if first_path else name

    def _recomputed(self, nodes, inputs, call) -> int:
        """Walks `nodes` and drops what they keep but their `inputs`, which are kept across
        the passes instead; returns the bytes dropped (held again while recomputed)."""
        before = set(self.sizes)
        outer = self.largest, self.gradients, self.transient
        self.largest = self.gradients = self.transient = 0
        for node in nodes:
            call(node)
        input_keys = {self.key(t) for t in inputs}
        inside = sum(self.sizes.pop(key) for key in set(self.sizes) - before
                     if key not in input_keys)
        self.recompute_peaks.append(inside + self.workspace)
        self.largest_anywhere = max(self.largest_anywhere, self.largest)
        self.largest, self.gradients, self.transient = outer
        for tensor in inputs:
            self.keep(tensor)
        return inside

    @property
    def workspace(self) -> int:
        """What the largest call walked (outside the ranges walked since) holds while it
        runs besides the kept tensors: its output's and inputs' gradients (`gradients`)
        or its own transient."""
        return max(self.gradients, self.transient)

    def call(self, node) -> None:
        operation = node.operation
        if id(operation) not in self.recomputed:
            if (not xla_rules.holds("backward_in_order", self.target)
                    or internals.is_graph_network(operation)
                    or isinstance(operation, keras.Sequential)
                    or id(operation) in self.inner_graphs):  # its own calls are counted
                self._call(node)
                return
            outer = self.gradients, self.transient
            self.gradients = self.transient = 0
            self._call(node)
            self.backward_peaks.append(self.kept_bytes() + self.workspace)
            self.gradients = max(outer[0], self.gradients)
            self.transient = max(outer[1], self.transient)
            return
        # Rematerialized: what it keeps inside is recomputed in the backward pass, one such
        # layer at a time; only its inputs are kept across the passes.
        self.segments.append((operation.name,
                              self._recomputed([node], node.input_tensors, self._call)))

    def _call(self, node) -> None:
        operation, inputs, outputs = node.operation, node.input_tensors, node.outputs
        if (internals.is_graph_network(operation) or isinstance(operation, keras.Sequential)
                or id(operation) in self.inner_graphs):
            self.nested(node)
            return
        sizes = [sample_bytes(tensor.shape, self.dtype_of(tensor)) for tensor in outputs]
        self.largest = max([self.largest] + sizes)
        # Its output's gradient, and its inputs' beside it: as large as the output where
        # the inputs are (their gradients are slices or views of it), else the inputs' own
        # (a head's logits from a narrow input: one tensor of the logits' size).
        into = sum(sample_bytes(tensor.shape, self.dtype_of(tensor)) for tensor in inputs
                   if None not in tuple(tensor.shape)[1:])
        self.gradients = max(self.gradients, max(sizes, default=0)
                             + min(max(sizes, default=0), into)
                             * (xla_rules.gradient_maps(self.target, operation) - 1))
        viewing = isinstance(operation, layer_rules.VIEWS) or (
            isinstance(operation, layer_rules.DROPOUTS) and not operation.rate)
        if viewing and len(inputs) == 1:
            self.alias[(self.context, id(outputs[0]))] = self.key(inputs[0])
            return
        has_trainable = self.has_trainable(operation)
        if not has_trainable and not any(self.key(t) in self.needs_grad for t in inputs):
            return
        self.needs_grad.update(self.key(t) for t in outputs)
        if isinstance(operation, keras.layers.Layer) and layer_rules.apply(
                self, operation, inputs, outputs, has_trainable):
            self.rule_transient(operation, inputs, outputs, has_trainable)
            return
        self.general(node, has_trainable)

    def rule_transient(self, layer, inputs, outputs, has_trainable: bool) -> None:
        """The transient of a layer `layer_rules` covers, when the layer keeps its input's
        shape (normalization, activations, dropout: per element, or per channel).

        Its transient is then the same multiple of its input at any size: traced once per
        configuration, on a copy of the layer built for a small input of the same rank and
        last axis, and scaled. The other rule layers (pooling, resizing, merges) hold about
        two tensors of their size, which the workspace's `2 × largest` already counts. On
        JAX a trace reports no transient (XLA fuses element-wise ops), so no copy is made."""
        if (self.trace_call is not gradient_trace.trace_call_tensorflow
                or len(inputs) != 1 or len(outputs) != 1 or isinstance(layer, keras.layers.RNN)
                or tuple(inputs[0].shape) != tuple(outputs[0].shape)):
            return
        dtype = keras.backend.standardize_dtype(inputs[0].dtype)
        grad_in = self.key(inputs[0]) in self.needs_grad
        # Every axis between the batch and the last one made small; the last (channels,
        # features, a softmax's classes) at most `_SMALL_LAST_AXIS`, so that a reduction
        # along it is sized too.
        last = inputs[0].shape[-1]
        small = ((None,) + (4,) * (len(inputs[0].shape) - 2)
                 + ((min(last, _SMALL_LAST_AXIS) if last else last),))
        key = (self.trace_call.__name__, type(layer), _config_key(layer), dtype,
               str(getattr(layer, "compute_dtype", "")), small, grad_in, has_trainable)
        if key not in _TRANSIENTS:
            if len(_TRANSIENTS) >= _MAX_TRACES:
                _TRANSIENTS.clear()
            _TRANSIENTS[key] = self._small_transient(layer, dtype, small, last, grad_in,
                                                     has_trainable)
        ratio = _TRANSIENTS[key]
        if ratio:
            self.transient = max(self.transient, int(ratio * max(
                self.sample_bytes(inputs[0]), self.sample_bytes(outputs[0]))))

    def _small_transient(self, layer, dtype, small, last, grad_in, has_trainable) -> float:
        """`layer`'s transient over its largest tensor, from a copy traced at the `small`
        input shape, or with its own `last` axis where the copy does not keep the narrower
        shape (a `Dense` as wide as its input); 0 when no copy can be made or traced."""
        try:
            copy = type(layer).from_config(layer.get_config())
            if small[-1] != last and not _keeps_shape(copy, small, dtype):
                small = small[:-1] + (last,)
                # Anew: asking for its output spec may have built the copy at the narrow width.
                copy = type(layer).from_config(layer.get_config())
            copy.build(small)
        except Exception:  # noqa: BLE001 - no copy of it: its transient stays uncounted
            return 0.0
        training = internals.call_has_training_arg(copy)

        def call(xs):
            return copy(xs[0], training=True) if training else copy(xs[0])

        result = self.trace(copy, call, [keras.KerasTensor(small, dtype=dtype)], [grad_in],
                            has_trainable, extra_key="transient", record=False)
        if result is None or not result.output_bytes:
            return 0.0
        return result.transient_bytes / max(sample_bytes(small, dtype), *result.output_bytes)

    def nested(self, node) -> None:
        inner = self.inner_graphs.get(id(node.operation)) or segments.sized_graph(
            internals.functional_of(node.operation), node)
        outer_keys = [self.key(t) for t in node.input_tensors]
        outer_context, self.context = self.context, self.context + (id(node),)
        outer_path = self.path
        self.path = f"{outer_path}/{node.operation.name}" if outer_path else node.operation.name
        for outer_key, inner_input in zip(outer_keys, inner.inputs):
            self.alias[(self.context, id(inner_input))] = outer_key
        self.walk(inner)
        inner_keys = [self.key(t) for t in inner.outputs]
        self.context, self.path = outer_context, outer_path
        for outer, inner_key in zip(node.outputs, inner_keys):
            self.alias[(self.context, id(outer))] = inner_key

    # -- the general path -------------------------------------------------------------------
    def general(self, node, has_trainable: bool) -> None:
        operation, inputs = node.operation, node.input_tensors
        differentiable = [self.key(t) in self.needs_grad for t in inputs]

        def call(xs):
            args, kwargs = node.arguments.fill_in({id(t): x for t, x in zip(inputs, xs)})
            if (isinstance(operation, keras.layers.Layer)
                    and internals.call_has_training_arg(operation)):
                kwargs = {**kwargs, "training": True}
            return operation(*args, **kwargs)

        result = self.trace(operation, call, inputs, differentiable, has_trainable,
                            extra_key=repr(node.arguments.convert(_placeholder)))
        if result is None:
            for tensor in list(inputs) + list(node.outputs):
                self.keep(tensor)
            return
        if xla_rules.element_wise(self, inputs, node.outputs, result):
            return
        for index in result.kept_inputs:
            self.keep(inputs[index])
        for index in result.kept_outputs:
            self.keep(node.outputs[index])
        self.keep_internal(result)

    def keep_internal(self, result: gradient_trace.TracedCall, repeat: int = 1) -> None:
        """Keeps the call's internal tensors (`repeat` times: once per timestep) and notes
        its largest tensor and its transient (held once: one call runs at a time)."""
        scale = (itemsize(self.override), 4) if self.override else (1, 1)
        broadcasts = tuple(entry for entry in result.broadcasts
                           if not xla_rules.holds("broadcast", self.target))
        widened, narrowed = dict(result.widened), dict(result.narrowed)
        held = max(result.output_bytes, default=0)  # the largest tensor kept, or an output
        shapes = result.internal_shapes
        for index, (nbytes, dtype) in enumerate(result.internal + broadcasts):
            shape = shapes[index] if index < len(shapes) else None
            nbytes = xla_rules.residual_bytes(self.target, nbytes, dtype, self.override,
                                              derived=index in result.derived,
                                              fused=index in result.fused,
                                              read_whole=index in result.read_whole,
                                              narrowed=narrowed.get(index, 0),
                                              drawn=index in result.drawn,
                                              widened=widened.get(index, 0))
            if dtype == "float32":
                nbytes = nbytes * scale[0] // scale[1]
            held = max(held, nbytes)
            if nbytes:
                # Its shape and the itemsize it is counted in, where it is one tensor.
                elements = max(math.prod(shape), 1) if shape is not None else 0
                layout = ((shape, nbytes // elements) if elements and repeat == 1
                          and nbytes % elements == 0 else None)
                self.keep_bytes(nbytes * repeat, layout=layout)
        zeros = xla_rules.traced_zero_maps(self.target, result.windows)
        if zeros:
            self.keep_bytes(zeros * repeat * scale[0] // scale[1])
        self.largest = max(self.largest, result.largest_bytes)
        # A tensor inside the call, its gradient beside it (an output's is counted with the
        # call's gradients); where XLA fuses the rest into what reads it, of what it keeps.
        inside = held if self.maps == 1 else result.largest_bytes
        if inside > max(result.output_bytes, default=0):
            self.gradients = max(self.gradients, self.maps * inside)
        self.transient = max(self.transient, result.transient_bytes * scale[0] // scale[1],
                             xla_rules.traced_transient(self.target, result.windows)
                             * scale[0] // scale[1])

    def recurrent(self, layer, sequence, has_trainable: bool) -> None:
        """A recurrent layer keeps what one step of its cell keeps, once per timestep."""
        cell = layer.cell
        sizes = cell.state_size if isinstance(cell.state_size, (list, tuple)) else [
            cell.state_size]
        dtype = keras.backend.standardize_dtype(sequence.dtype)
        step = [(tuple(sequence.shape[2:]), dtype)] + [
            ((s,) if isinstance(s, int) else tuple(s), layer.compute_dtype) for s in sizes]
        timesteps = sequence.shape[1]
        grad_in = self.key(sequence) in self.needs_grad

        def call(xs):
            states = list(xs[1:])
            return cell(xs[0], states if len(states) > 1 or isinstance(
                cell.state_size, (list, tuple)) else states[0], training=True)

        specs = [keras.KerasTensor((None,) + shape, dtype=d) for shape, d in step]
        result = self.trace(cell, call, specs, [grad_in] + [True] * len(sizes),
                            has_trainable, extra_key="cell")
        if result is None or timesteps is None:
            self.keep(sequence)
            return
        kept_in, kept_out = set(result.kept_inputs), set(result.kept_outputs)
        total = sample_bytes(specs[0].shape, specs[0].dtype) * timesteps if 0 in kept_in else 0
        for j, spec in enumerate(specs[1:]):
            # State j enters step t as input j + 1 and leaves step t - 1 as output j + 1 (a
            # built-in cell's output 0 is state 0 too): kept on either side, it is one tensor
            # per step, plus the initial (or last) state when both sides keep it.
            as_input = j + 1 in kept_in
            as_output = j + 1 in kept_out or (j == 0 and 0 in kept_out)
            if as_input or as_output:
                nbytes = sample_bytes(spec.shape, spec.dtype)
                total += nbytes * (timesteps + int(as_input and as_output))
        self.keep_bytes(total)
        self.keep_internal(result, repeat=timesteps)

    def trace(self, operation, call, inputs, differentiable, has_trainable, extra_key="",
              record=True):
        """The backend's `gradient_trace` for one call, cached; None when it cannot be traced.
        `record`: name the call among the plan's traced calls (or fallbacks)."""
        name = type(operation).__name__
        weights = list(getattr(operation, "weights", []))
        trainable = [w for w in getattr(operation, "trainable_weights", [])
                     if has_trainable and id(w) not in self.frozen]
        trainable_ids = {id(w) for w in trainable}
        others = [w for w in weights if id(w) not in trainable_ids]
        specs = [(tuple(t.shape[1:]), keras.backend.standardize_dtype(t.dtype)) for t in inputs]
        cache_key = (self.trace_call.__name__, type(operation), _config_key(operation), extra_key,
                     str(getattr(operation, "compute_dtype", "")), tuple(specs),
                     tuple(differentiable), tuple((tuple(w.shape), str(w.dtype),
                                                   id(w) in trainable_ids) for w in weights))
        if cache_key in _TRACES:
            result, reason = _TRACES[cache_key]
        else:
            result, reason = None, ""
            try:
                result = self.trace_call(call, specs, differentiable=differentiable,
                                         trainable=trainable, non_trainable=others)
            except Exception as error:  # noqa: BLE001 - any failure: the upper bound, named
                reason = f"{name} ({type(error).__name__}: {_first_line(error)})"
            if len(_TRACES) >= _MAX_TRACES:
                _TRACES.clear()
            _TRACES[cache_key] = result, reason
        if record and result is None:
            self.fallbacks.add(reason)
        elif record:
            self.traced.add(name)
            if result.has_loop:
                self.loops.add(name)
        return result


def _placeholder(value):
    return "<tensor>" if isinstance(value, keras.KerasTensor) else value


def _keeps_shape(layer, shape, dtype) -> bool:
    """Whether `layer`, unbuilt, maps an input of `shape` to an output of the same shape."""
    try:
        return tuple(layer.compute_output_spec(keras.KerasTensor(shape, dtype=dtype)).shape) \
            == tuple(shape)
    except Exception:  # noqa: BLE001 - it cannot say: traced at its own width
        return False


def _config_key(operation) -> str:
    """The configuration as a cache key. Non-zero float settings (dropout and
    stochastic-depth rates, which change from block to block) are one value: they decide
    whether a mask exists, not its size; sizes are in the key through weights and shapes."""
    try:
        config = operation.get_config()
    except Exception:  # noqa: BLE001 - a config that cannot be read: the weights still differ
        return ""

    def normal(value):
        if isinstance(value, float):
            return "float>0" if value else 0.0
        return value

    return repr(sorted((k, keras.tree.map_structure(normal, v)) for k, v in config.items()
                       if k != "name"))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else ""
