"""When nothing fits: the levers a user has, each checked by the planner, smallest change first.

The levers, in the order they are tried (least change to the run first): rematerialization
("full": it changes no numerics, only time; functional models), mixed precision,
an optimizer with fewer slots (SGD with momentum, Adafactor) instead of the one asked for, a
frozen backbone (train the head only), then the caller's smaller variants (smaller images,
a smaller model of the family). Single changes are checked before pairs, pairs before
triples; the first that fits is the answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Sequence

import keras

from tfmem import _keras_internals as internals
from tfmem.memory.memory_plan import Alternative, MemoryPlan
from tfmem.memory.optimizer_state import optimizer_slot_bytes
from tfmem.memory.plan_settings import PlanSettings
from tfmem.remat import runner
from tfmem.remat.spec import RematSpec

# Combinations of more changes than this are not searched: the answer would not be "a change".
_MAX_CHANGES = 3


@dataclasses.dataclass(frozen=True)
class Lever:
    """One change to try. Levers of the same `group` exclude each other.

    `apply(settings, model)` returns the plan settings with the change made (a
    `dataclasses.replace`), for the model being planned (the asked one, or a variant `build`
    makes); a lever that only changes the model keeps the settings. `setting` is the change
    as an `(argument, value)` of the run, which messages spell as the caller's switch.
    """

    description: str
    group: str
    apply: Callable[[PlanSettings, keras.Model], PlanSettings] = lambda settings, model: settings
    build: Callable[[], keras.Model] | None = None
    setting: tuple[str, object] | None = None


def backbone_ids(model: keras.Model) -> frozenset[int]:
    """ids of the largest nested model inside `model` (its layers and weights), or empty."""
    nested = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    if not nested:
        return frozenset()
    backbone = max(nested, key=lambda layer: layer.count_params())
    layers = [backbone] + internals.flatten_layers(backbone)
    return frozenset([id(layer) for layer in layers] + [id(w) for w in backbone.weights])


def levers_for(model: keras.Model, base: MemoryPlan,
               smaller_variants: Sequence[tuple[str, Callable[[], keras.Model]]] = ()
               ) -> list[Lever]:
    """The levers that could lower `base`'s peak, in the order they are tried."""
    found = []
    graph = internals.functional_of(model)
    if (internals.is_graph_network(graph) and not base.rematerialized
            and RematSpec.parse(getattr(model, "rematerialize", None)).mode
            not in ("full", "auto")
            and runner.saves_memory(base.device_kind)):
        # First: it changes no numerics, only time.
        found.append(Lever("rematerialize full", "rematerialize", _rematerializing,
                           setting=("rematerialize", "full")))
    if base.precision == "float32":
        policy = "mixed_float16" if base.device_kind == "gpu" else "mixed_bfloat16"
        found.append(Lever(f"precision {policy}", "precision", _replacing(precision=policy),
                           setting=("precision", policy)))
    trainable = model.trainable_variables
    for description, optimizer, name in (
            ("optimizer SGD (momentum 0.9)", keras.optimizers.SGD(momentum=0.9), "sgd"),
            ("optimizer Adafactor", keras.optimizers.Adafactor(), "adafactor")):
        if optimizer_slot_bytes(optimizer, trainable) < base.optimizer_bytes:
            found.append(Lever(description, "optimizer", _replacing(optimizer=optimizer),
                               setting=("optimizer", name)))
    if backbone_ids(model):
        found.append(Lever("frozen backbone (train the head only)", "freeze",
                           lambda settings, candidate: dataclasses.replace(
                               settings, frozen=backbone_ids(candidate)),
                           setting=("freeze_backbone", True)))
    for description, build in smaller_variants:
        found.append(Lever(description, "model", build=build,
                           setting=getattr(build, "setting", None)))
    return found


def _rematerializing(settings: PlanSettings, model: keras.Model) -> PlanSettings:
    if not internals.is_graph_network(internals.functional_of(model)):
        return settings  # a subclassed variant: its blocks would have to be named
    return dataclasses.replace(settings, rematerialize=RematSpec("full"))


def _replacing(**changes) -> Callable[[PlanSettings, keras.Model], PlanSettings]:
    return lambda settings, model: dataclasses.replace(settings, **changes)


def search(model: keras.Model, base: MemoryPlan, settings: PlanSettings,
           evaluate: Callable[[keras.Model, PlanSettings], MemoryPlan],
           smaller_variants: Sequence[tuple[str, Callable[[], keras.Model]]] = ()
           ) -> Alternative:
    """The smallest combination of levers whose plan fits, or an empty `Alternative`.

    Args:
        model: the model as asked for.
        base: its plan, which does not fit.
        settings: the settings `base` was planned with.
        evaluate: plans `(model, settings)` with micro-batch × k chosen.
        smaller_variants: `(description, builder)` pairs, built only when reached.
    """
    levers = levers_for(model, base, smaller_variants)
    built: dict[int, keras.Model | None] = {}
    tried = []
    for size in range(1, min(_MAX_CHANGES, len(levers)) + 1):
        for combination in itertools.combinations(range(len(levers)), size):
            groups = [levers[i].group for i in combination]
            if len(set(groups)) < len(groups):
                continue
            candidate = model
            for i in combination:  # at most one builds a model (one "model" group)
                if levers[i].build is not None:
                    if i not in built:
                        built[i] = _build(levers[i], tried)
                    candidate = built[i]
            if candidate is None:
                continue
            changed = settings
            for i in combination:
                changed = levers[i].apply(changed, candidate)
            descriptions = tuple(levers[i].description for i in combination)
            switched = tuple(levers[i].setting for i in combination if levers[i].setting)
            tried.append(" + ".join(descriptions))
            result = evaluate(candidate, changed)
            if result.fits:
                return Alternative(descriptions, result.micro_batch_size,
                                   result.accumulation_steps,
                                   result.peak_bytes(result.micro_batch_size,
                                                     result.accumulation_steps), tuple(tried),
                                   switched)
    return Alternative((), 0, 0, 0, tuple(tried))


def _build(lever: Lever, tried: list) -> keras.Model | None:
    try:
        return lever.build()
    except (ValueError, TypeError) as error:  # a size the model does not accept
        tried.append(f"{lever.description} (not buildable: {str(error).splitlines()[0]})")
        return None


def registry_variants(name: str, *, image_size: int | tuple[int, int], **build_kwargs
                      ) -> list[tuple[str, Callable[[], keras.Model]]]:
    """Smaller variants of a `tfmem.models` name for `plan(smaller_variants=...)`: ¾ and ½
    of the image size (height and width, valid sizes only), then the next smaller model of
    its family.

    The builders leave weights uninitialised (the planner reads shapes only).

    Example:
        >>> [d for d, _ in registry_variants("efficientnetv2-xl", image_size=384)]
        ['image size 288', 'image size 192', 'model efficientnetv2-l']
    """
    from tfmem import models  # the registry, only where its variants are asked for

    if name not in models.MODELS:
        return []
    spec = models.MODELS[name]
    step = max(spec.image_size_multiple, 32)
    sizes = tuple(image_size) if isinstance(image_size, (tuple, list)) else (image_size,) * 2
    variants = []
    for fraction in (0.75, 0.5):
        height, width = (int(size * fraction) // step * step for size in sizes)
        # A square size is one number ("image size 288", `--image-size 288`).
        square = height == width
        description = f"image size {height}" if square else f"image size {height}×{width}"
        if all(spec.min_image_size <= new < size for new, size in zip((height, width), sizes)
               ) and all(description != d for d, _ in variants):
            setting = ("image_size", height if square else f"{height},{width}")
            variants.append((description, _deferred(name, (height, width), build_kwargs,
                                                    setting)))
    siblings = [other for other in models.MODELS if _family(other) == _family(name)]
    smaller = siblings[:siblings.index(name)]
    if smaller:
        variants.append((f"model {smaller[-1]}",
                         _deferred(smaller[-1], image_size, build_kwargs,
                                   ("model", smaller[-1]))))
    return variants


def _family(name: str) -> str:
    """"efficientnetv2-xl" → "efficientnetv2-#", "resnet50v2" → "resnet#v2"; registry order
    within a family is smallest first."""
    if "-" in name:
        return name.rsplit("-", 1)[0] + "-#"
    return re.sub(r"\d+", "#", name)


def _deferred(name: str, image_size: int | tuple[int, int], build_kwargs: dict,
              setting: tuple[str, object]) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        from tfmem import models  # the registry, only when the variant is built

        with models.shapes_only():
            return models.build(name, image_size=image_size, **build_kwargs)
    build.setting = setting  # the variant as a setting of the run (`--image-size 288`)
    return build
