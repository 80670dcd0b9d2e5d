r"""Streaming reader: peak memory does not grow with the dataset; throughput near the ceiling.

    python benchmarks/data_pipeline.py --mid_gb 2           # 0.5, 2 and 4 GB, as in docs/benchmarks.md
    python benchmarks/data_pipeline.py --small_gb 0.05 --big_gb 0.2 --throughput_images 500

Writes TFRecord sets of photo-like 500×375 JPEGs (~42 KB, crops of scikit-image's sample
photographs) to a temporary directory under /tmp (deleted at the end; `--sets_dir` keeps them
for the next run instead), then runs each case in its own process and prints three tables:

1. Peak RSS (the process's own high-water mark, VmHWM) streaming one epoch of each set through
   `tfmem.image_dataset` with its defaults (decode + resize to 224, shuffle buffer, batch 64),
   beside the naive way: decode everything into a numpy array, then
   `tf.data.Dataset.from_tensor_slices`. Target: streaming the big set peaks < 5% above
   streaming the small one. All sets use 32 MB shards (the small one has 16). What the reader
   holds is set by its arguments, not by the set: `prefetch_batches` decoded batches, the
   shuffle buffer of encoded records, and the open shards, 3 per `num_parallel_reads` (tf.data's
   interleave opens 2 ahead of each one it reads), each with a block of ~35 records. A set
   with fewer shards than that window never fills it, which is why the old default of 16
   reads (48 shards open at most: the small set filled 16 of them, the big ones all 48) grew
   by 15–20% (2026-11-21); `--compare_reads 16` (on by default) streams the small and big
   sets with it again. Run with glibc's default malloc, with MALLOC_ARENA_MAX=2 (fewer
   per-thread arenas) and with tcmalloc through LD_PRELOAD (`apt-get install
   libtcmalloc-minimal4`; the row is skipped, with a message, without it). `--mid_gb 2` adds
   a third set in between.
2. Peak RSS of one epoch of the small set whose consumer pauses 2 s every 20 batches (as
   validation or a checkpoint does), with `prefetch_batches` at its default and at
   `tf.data.AUTOTUNE`: tf.data's prefetch autotuner doubles its buffer each time a full buffer
   drains, so the autotuned one keeps growing with such pauses.
3. Images/s of `image_dataset` reading from disk vs a bare `tf.data` decode + resize loop over
   the same JPEG bytes held in memory (map and prefetch AUTOTUNE), same cores, same batch.
   Target: ratio >= 0.9. Each is run 3 times, alternating; best and median are printed (the
   machine may be shared).
"""

import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_SMALL_GB = flags.DEFINE_float("small_gb", 0.5, "Size of the small set in GB.")
_BIG_GB = flags.DEFINE_float("big_gb", 4.0, "Size of the big set in GB.")
_MID_GB = flags.DEFINE_float("mid_gb", None, "Also stream a set of this size (GB) in between.")
_SHARD_SIZE_MB = flags.DEFINE_float(
    "shard_size_mb", 32, "Shard size of both sets: small enough that even the small set has "
    "16 shards, so both read 16 shards at a time and only the dataset size differs.")
_THROUGHPUT_IMAGES = flags.DEFINE_integer("throughput_images", 3000, "Images per speed run.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size of every case.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp", "Where the temporary sets are written.")
_SETS_DIR = flags.DEFINE_string(
    "sets_dir", None, "Keep the sets here between runs instead of a temporary directory: a set "
    "already written there (same size) is reused, and nothing is deleted. For iterating.")
_NAIVE_BIG = flags.DEFINE_bool("naive_big", False, "Also run the naive way on the big set "
                               "(needs ~2 × 150 KB × images of RAM).")
_SPEED_RUNS = flags.DEFINE_integer("speed_runs", 3, "Alternating runs of each speed case.")
_COMPARE_READS = flags.DEFINE_integer(
    "compare_reads", 16, "Also stream the small and big sets with this `num_parallel_reads` "
    "(16: the default before 2026-11-21), default malloc; 0 skips it.")
_PAUSE_EVERY = flags.DEFINE_integer(
    "pause_every", 20, "Prefetch table: the consumer pauses after every this many batches "
    "(as validation or a checkpoint does); 0 skips the table.")
_PAUSE_SECONDS = flags.DEFINE_float("pause_seconds", 2.0, "Length of each pause.")
_CASE = flags.DEFINE_string("case", None, "Internal: run one case in this process.")
_DIR = flags.DEFINE_string("dir", None, "Internal: the set a case reads.")
_READS = flags.DEFINE_integer("reads", None, "Internal: `num_parallel_reads` of the case.")
_PREFETCH = flags.DEFINE_integer("prefetch", None, "Internal: `prefetch_batches` of the case "
                                 "(-1: tf.data.AUTOTUNE).")
_PAUSES = flags.DEFINE_bool("pauses", False, "Internal: the consumer pauses.")

IMAGE_SIZE = (224, 224)
# glibc gives each thread that allocates its own arena (up to 8 per core) and keeps freed memory
# in them; a long run with many reader threads creeps up that way. Measured three ways: default,
# fewer arenas, and tcmalloc (per-thread caches returned to one central heap) preloaded.
_TCMALLOC = "libtcmalloc_minimal.so.4"
_MALLOCS = ("default", "MALLOC_ARENA_MAX=2", "tcmalloc")
_SOURCE_SIZE = (375, 500)
_POOL = 64


def _malloc_env(malloc: str):
    """The environment a case runs under for `malloc`, or None when it is not installed."""
    if malloc == "default":
        return {}
    if malloc.startswith("MALLOC_ARENA_MAX="):
        return {"MALLOC_ARENA_MAX": malloc.split("=")[1]}
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.split("\n")
    paths = [line.split("=> ")[-1].strip() for line in found if f"{_TCMALLOC} " in line]
    return {"LD_PRELOAD": paths[0]} if paths else None


def _peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: Linux carries the parent's peak into a child's ru_maxrss across
    # fork/exec (measured: a child of a 600 MB parent reported 611 MB, VmHWM 11 MB), which here
    # put a 733 MB floor (the parent that wrote the sets) under every case.
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def _photo_pool():
    """64 distinct JPEGs: random 375×500 crops (and flips) of scikit-image's photographs."""
    import numpy as np
    import skimage.data
    import tensorflow as tf

    photos = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.rocket(),
              skimage.data.hubble_deep_field()]
    rng = np.random.default_rng(0)
    pool = []
    for index in range(_POOL):
        photo = photos[index % len(photos)]
        scale = max(_SOURCE_SIZE[0] / photo.shape[0], _SOURCE_SIZE[1] / photo.shape[1]) * 1.3
        big = tf.image.resize(photo, [int(photo.shape[0] * scale), int(photo.shape[1] * scale)])
        top = rng.integers(0, big.shape[0] - _SOURCE_SIZE[0])
        left = rng.integers(0, big.shape[1] - _SOURCE_SIZE[1])
        crop = tf.cast(big[top:top + _SOURCE_SIZE[0], left:left + _SOURCE_SIZE[1]], tf.uint8)
        crop = crop[:, ::-1] if index % 2 else crop
        pool.append(tf.io.encode_jpeg(crop, quality=90).numpy())
    return pool


def _write_set(directory: str, gigabytes: float, pool) -> dict:
    import tensorflow as tf

    import tfmem

    mean = sum(len(p) for p in pool) / len(pool) + 60  # + feature keys and framing
    num = int(gigabytes * 1e9 / mean)
    source = tf.data.Dataset.from_tensor_slices((pool, [i % 10 for i in range(len(pool))]))
    source = source.repeat().take(num)
    start = time.perf_counter()
    manifest = tfmem.write_image_tfrecords(source, directory, class_names=list("abcdefghij"),
                                           shard_size_mb=_SHARD_SIZE_MB.value)
    return {"examples": manifest.num_examples, "shards": len(manifest.shards),
            "bytes": manifest.num_bytes, "seconds": time.perf_counter() - start}


def _reuse_set(directory: str) -> dict | None:
    """A set kept by an earlier run with `--sets_dir` (its manifest is written last)."""
    import tfmem

    if not os.path.exists(os.path.join(directory, "manifest.json")):
        return None
    manifest = tfmem.read_manifest(directory)
    return {"examples": manifest.num_examples, "shards": len(manifest.shards),
            "bytes": manifest.num_bytes, "seconds": 0.0}


# ---- cases, each run in a fresh process --------------------------------------------------


def _reader_arguments() -> dict:
    """`num_parallel_reads` / `prefetch_batches` a case was given; none: the product default."""
    arguments = {}
    if _READS.value is not None:
        arguments["num_parallel_reads"] = _READS.value
    if _PREFETCH.value is not None:
        arguments["prefetch_batches"] = _PREFETCH.value  # -1 is tf.data.AUTOTUNE
    return arguments


def _case_stream(directory: str) -> dict:
    import tfmem

    dataset = tfmem.image_dataset(directory, image_size=IMAGE_SIZE, training=True,
                                  batch_size=_BATCH_SIZE.value, seed=0, **_reader_arguments())
    baseline = _peak_rss_mb()
    start, images, batches = time.perf_counter(), 0, 0
    for batch, _ in dataset:
        images += batch.shape[0]
        batches += 1
        if _PAUSES.value and batches % _PAUSE_EVERY.value == 0:
            time.sleep(_PAUSE_SECONDS.value)  # a validation run or a checkpoint, say
    with open("/proc/self/maps") as maps:  # proof that LD_PRELOAD took effect
        tcmalloc = _TCMALLOC in maps.read()
    defaults = inspect.signature(tfmem.image_dataset).parameters
    return {"images": images, "seconds": time.perf_counter() - start,
            "baseline_mb": baseline, "peak_mb": _peak_rss_mb(), "tcmalloc": tcmalloc,
            **{name: defaults[name].default for name in ("num_parallel_reads", "prefetch_batches")},
            **_reader_arguments()}


def _case_naive(directory: str) -> dict:
    import numpy as np
    import tensorflow as tf

    import tfmem

    manifest = tfmem.read_manifest(directory)
    baseline = _peak_rss_mb()
    start = time.perf_counter()
    images = np.empty((manifest.num_examples, *IMAGE_SIZE, 3), np.uint8)
    labels = np.empty(manifest.num_examples, np.int64)
    for index, record in enumerate(tf.data.TFRecordDataset(manifest.files)):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        image = tf.io.decode_jpeg(feature["image"].bytes_list.value[0], channels=3)
        images[index] = tf.cast(tf.image.resize(image, IMAGE_SIZE), tf.uint8)
        labels[index] = feature["label"].int64_list.value[0]
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(1024).batch(
        _BATCH_SIZE.value, drop_remainder=True).map(lambda x, y: (tf.cast(x, tf.float32), y))
    count = sum(int(x.shape[0]) for x, _ in dataset)
    return {"images": count, "seconds": time.perf_counter() - start,
            "baseline_mb": baseline, "peak_mb": _peak_rss_mb()}


def _case_reader_speed(directory: str) -> dict:
    import tfmem

    dataset = tfmem.image_dataset(directory, image_size=IMAGE_SIZE, training=True,
                                  batch_size=_BATCH_SIZE.value, seed=0)
    return _time_batches(dataset)


def _case_bare_speed(directory: str) -> dict:
    import tensorflow as tf

    import tfmem

    # The same JPEG bytes the reader decodes, but already in memory: no files, no parsing.
    manifest = tfmem.read_manifest(directory)
    payloads = []
    for record in tf.data.TFRecordDataset(manifest.files).take(_THROUGHPUT_IMAGES.value
                                                                 + _BATCH_SIZE.value * 2):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        payloads.append(feature["image"].bytes_list.value[0])

    def decode(data):
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        return tf.image.resize(image, IMAGE_SIZE), 0  # (image, label), as the reader yields

    dataset = tf.data.Dataset.from_tensor_slices(payloads).map(
        decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False).batch(
        _BATCH_SIZE.value, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return _time_batches(dataset)


def _time_batches(dataset) -> dict:
    import tensorflow as tf

    iterator = iter(dataset)
    next(iterator)  # warm-up: tracing, thread pools, first reads
    images, start = 0, time.perf_counter()
    while images < _THROUGHPUT_IMAGES.value:
        images += int(tf.nest.flatten(next(iterator))[0].shape[0])  # batch of images first
    seconds = time.perf_counter() - start
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds}


_CASES = {"stream": _case_stream, "naive": _case_naive, "reader_speed": _case_reader_speed,
          "bare_speed": _case_bare_speed}


def _run_case(case: str, directory: str, *, reads: int | None = None,
              prefetch: int | None = None, pauses: bool = False, **env) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), f"--case={case}", f"--dir={directory}",
            f"--batch_size={_BATCH_SIZE.value}", f"--throughput_images={_THROUGHPUT_IMAGES.value}",
            f"--pause_every={_PAUSE_EVERY.value}", f"--pause_seconds={_PAUSE_SECONDS.value}"]
    argv += [f"--reads={reads}"] if reads is not None else []
    argv += [f"--prefetch={prefetch}"] if prefetch is not None else []
    argv += ["--pauses"] if pauses else []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(argv, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=root, **env))
    if result.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    if _CASE.value:
        print(json.dumps(_CASES[_CASE.value](_DIR.value)))
        return
    workdir = _SETS_DIR.value or tempfile.mkdtemp(prefix="tfmem-bench-", dir=_WORKDIR.value)
    try:
        pool = _photo_pool()
        sets = {}
        sizes = [("small", _SMALL_GB.value), ("mid", _MID_GB.value), ("big", _BIG_GB.value)]
        for name, gigabytes in [(n, g) for n, g in sizes if g]:
            directory = os.path.join(workdir, f"{gigabytes:g}gb-{_SHARD_SIZE_MB.value:g}mb")
            sets[name] = _reuse_set(directory) or _write_set(directory, gigabytes, pool)
            sets[name]["dir"] = directory
            print(f"wrote {name}: {sets[name]['examples']} examples, {sets[name]['shards']} "
                  f"shards, {sets[name]['bytes'] / 1e9:.2f} GB in {sets[name]['seconds']:.0f} s",
                  flush=True)
        rows, mallocs = {}, []
        for malloc in _MALLOCS:
            env = _malloc_env(malloc)
            if env is None:
                print(f"skipped {malloc}: {_TCMALLOC} not found by `ldconfig -p` "
                      "(apt-get install libtcmalloc-minimal4)", flush=True)
                continue
            mallocs.append(malloc)
            for name in sets:
                rows[("stream", name, malloc)] = _run_case("stream", sets[name]["dir"], **env)
                print("stream", name, malloc, rows[("stream", name, malloc)], flush=True)
        if _COMPARE_READS.value:
            mallocs.append(f"default, num_parallel_reads={_COMPARE_READS.value}")
            for name in ("small", "big"):
                key = ("stream", name, mallocs[-1])
                rows[key] = _run_case("stream", sets[name]["dir"], reads=_COMPARE_READS.value)
                print(*key, rows[key], flush=True)
        pauses = {}
        if _PAUSE_EVERY.value:
            for prefetch in (None, -1):  # the default depth, then tf.data.AUTOTUNE
                pauses[prefetch] = _run_case("stream", sets["small"]["dir"], prefetch=prefetch,
                                             pauses=True)
                print("stream with pauses, prefetch", prefetch, pauses[prefetch], flush=True)
        rows[("naive", "small", "default")] = _run_case("naive", sets["small"]["dir"])
        if _NAIVE_BIG.value:
            rows[("naive", "big", "default")] = _run_case("naive", sets["big"]["dir"])
        speeds = {"reader_speed": [], "bare_speed": []}
        for _ in range(_SPEED_RUNS.value):
            for case in speeds:
                speeds[case].append(_run_case(case, sets["small"]["dir"])["images_per_s"])
        _print_tables(sets, rows, speeds, mallocs, pauses)
    finally:
        if not _SETS_DIR.value:
            shutil.rmtree(workdir, ignore_errors=True)


def _print_tables(sets, rows, speeds, mallocs, pauses):
    print("\n| case | malloc | set | examples | peak RSS | vs streaming small, same malloc |")
    print("|---|---|---|---|---|---|")
    for (case, name, malloc), row in rows.items():
        size = f"{sets[name]['bytes'] / 1e9:.2f} GB"
        ratio = row["peak_mb"] / rows[("stream", "small", malloc)]["peak_mb"]
        label = "image_dataset (streaming)" if case == "stream" else "numpy + from_tensor_slices"
        print(f"| {label} | {malloc} | {size} | {sets[name]['examples']} | "
              f"{row['peak_mb']:.0f} MB | {ratio:.2f}× |")
    if ("naive", "big", "default") not in rows:
        naive = rows[("naive", "small", "default")]  # grows linearly with the number of images
        scale = sets["big"]["examples"] / sets["small"]["examples"]
        estimate = naive["baseline_mb"] + (naive["peak_mb"] - naive["baseline_mb"]) * scale
        print(f"| numpy + from_tensor_slices | default | {sets['big']['bytes'] / 1e9:.2f} GB | "
              f"{sets['big']['examples']} | not run: ≈ {estimate:.0f} MB (extrapolated from "
              "the small set) | |")
    print()
    for malloc in mallocs:
        growth = (rows[("stream", "big", malloc)]["peak_mb"]
                  / rows[("stream", "small", malloc)]["peak_mb"] - 1)
        print(f"streaming peak RSS growth, big vs small set, {malloc}: {growth * 100:+.1f}% "
              "(target < 5%)")
    if pauses:
        print(f"\n| prefetch_batches (one epoch of the small set, a {_PAUSE_SECONDS.value:g} s "
              f"pause every {_PAUSE_EVERY.value} batches) | peak RSS | vs the default |")
        print("|---|---|---|")
        for prefetch, row in pauses.items():
            label = ("tf.data.AUTOTUNE" if prefetch is not None
                     else f"{row['prefetch_batches']} (default)")
            print(f"| {label} | {row['peak_mb']:.0f} MB | "
                  f"{row['peak_mb'] / pauses[None]['peak_mb']:.2f}× |")
    reader, bare = max(speeds["reader_speed"]), max(speeds["bare_speed"])
    print("\n| pipeline (decode + resize 224, batch "
          f"{_BATCH_SIZE.value}) | images/s (best of {len(speeds['bare_speed'])}) | runs | ratio |")
    print("|---|---|---|---|")
    print(f"| bare tf.data decode + resize, bytes in memory | {bare:.0f} | "
          f"{', '.join(f'{s:.0f}' for s in speeds['bare_speed'])} | 1.00 |")
    print(f"| tfmem.image_dataset from TFRecord files | {reader:.0f} | "
          f"{', '.join(f'{s:.0f}' for s in speeds['reader_speed'])} | {reader / bare:.2f} |")
    medians = [statistics.median(speeds[c]) for c in ("reader_speed", "bare_speed")]
    print(f"\nreader / bare ratio: {reader / bare:.2f} best-of, {medians[0] / medians[1]:.2f} "
          "median-of (target >= 0.9); "
          f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    app.run(main)
