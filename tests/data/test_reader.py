"""Writing and streaming TFRecords: real files in tmp_path, values checked against the source."""

import dataclasses
import inspect
import os
import re
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.data import pipeline
from tfrecord_framing import record_lengths
from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset

NUM_EXAMPLES = 40
HEIGHT, WIDTH = 12, 10


def _source(num_examples=NUM_EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(num_examples, HEIGHT, WIDTH, 3), dtype=np.uint8)
    labels = rng.integers(0, 3, size=num_examples)
    return images, labels


def _unlabelled(**kwargs):
    return tfmem.Schema(image_key="image", label_key=None, id_key="id", **kwargs)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """40 random 12x10 RGB images written unshuffled into shards of ~3 records."""
    images, labels = _source()
    directory = str(tmp_path_factory.mktemp("set"))
    manifest = tfmem.write_image_tfrecords(
        (images, labels), directory, shard_size_mb=0.001, class_names=["a", "b", "c"],
        shuffle=False)
    return images, labels, manifest


def test_round_trip_is_lossless_and_in_written_order(written):
    images, labels, manifest = written
    dataset = tfmem.image_dataset(manifest.directory, image_size=(HEIGHT, WIDTH),
                                  batch_size=NUM_EXAMPLES, training=False, num_parallel_reads=1)
    (read_images, read_labels), = list(dataset)
    assert read_images.dtype == tf.float32 and read_labels.dtype == tf.int32
    np.testing.assert_array_equal(read_images.numpy(), images.astype(np.float32))
    np.testing.assert_array_equal(read_labels.numpy(), labels)

    unit = tfmem.image_dataset(manifest.directory, image_size=(HEIGHT, WIDTH), batch_size=7,
                               training=False, data_range=(0, 1), num_parallel_reads=1)
    read = np.concatenate([x.numpy() for x, _ in unit])  # last batch of 5 kept for evaluation
    np.testing.assert_allclose(read, images / 255.0, rtol=0, atol=1e-7)


def test_manifest_counts_and_shard_sizes(written):
    images, labels, manifest = written
    assert tfmem.read_manifest(manifest.directory) == manifest
    assert tfmem.read_manifest(os.path.join(manifest.directory, "*.tfrecord")) == manifest
    assert manifest.num_examples == NUM_EXAMPLES and manifest.num_classes == 3
    assert manifest.class_names == ("a", "b", "c") and manifest.image_formats == ("png",)
    assert sum(s.num_examples for s in manifest.shards) == NUM_EXAMPLES
    limit = 1000  # shard_size_mb=0.001
    for index, (shard, path) in enumerate(zip(manifest.shards, manifest.files)):
        lengths = record_lengths(path)
        assert shard.num_examples == len(lengths)
        assert shard.num_bytes == os.path.getsize(path) == sum(lengths) + 16 * len(lengths)
        if index < len(manifest.shards) - 1:  # closed at the first record that crosses the limit
            assert shard.num_bytes - lengths[-1] - 16 < limit <= shard.num_bytes
    assert sorted(os.listdir(manifest.directory)) == sorted(
        [s.name for s in manifest.shards] + ["manifest.json"])


def test_training_batches_are_full_shuffled_and_complete(written):
    images, labels, manifest = written
    dataset = tfmem.image_dataset(manifest.directory, image_size=(6, 5), batch_size=8,
                                  training=True, seed=1)
    batches = list(dataset)
    assert len(batches) == int(dataset.cardinality()) == NUM_EXAMPLES // 8  # 5 full batches
    assert all(x.shape == (8, 6, 5, 3) for x, _ in batches)
    assert dataset.options().deterministic is False
    assert dataset.options().autotune.enabled is False  # fixed parallelism, no autotuner
    read_labels = np.concatenate([y.numpy() for _, y in batches])
    assert sorted(read_labels) == sorted(labels)  # 40 of 40, as 40 is a multiple of 8
    assert not np.array_equal(read_labels, labels)  # shuffled
    # Resized bilinearly, exactly as tf.image.resize does it on the source.
    expected = tf.image.resize(images, (6, 5)).numpy()
    for x, _ in batches:
        for image in x.numpy():
            assert np.min(np.abs(expected - image).reshape(NUM_EXAMPLES, -1).max(1)) < 1e-3


def test_cache_keeps_decoded_images_and_reshuffles_each_epoch(written):
    images, labels, manifest = written
    dataset = tfmem.image_dataset(manifest.directory, image_size=(HEIGHT, WIDTH), batch_size=40,
                                  training=True, cache=True, seed=3)
    epochs = [batch for _ in range(2) for batch in dataset]  # exhausted: the cache completes
    for x, y in epochs:  # every example once per epoch, pixels intact after the cache
        order = [int(np.flatnonzero((images == image).all(axis=(1, 2, 3)))[0])
                 for image in x.numpy().astype(np.uint8)]
        assert sorted(order) == list(range(NUM_EXAMPLES))
        np.testing.assert_array_equal(y.numpy(), labels[order])
    assert not np.array_equal(epochs[0][1].numpy(), epochs[1][1].numpy())  # new order


def test_reader_memory_is_set_by_its_arguments(written, constant_inputs):
    images, labels, manifest = written
    assert len(manifest.shards) == 20  # more than any cycle_length below, except "all"
    dataset = tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=8,
                                  training=True, seed=0)
    assert constant_inputs(dataset, "PrefetchDataset") == [2]  # prefetch_batches default
    # ParallelInterleaveDatasetV4: cycle_length (num_parallel_reads), block_length, ...
    assert constant_inputs(dataset, "ParallelInterleaveDatasetV4")[:2] == [4, 1]
    assert sorted(np.concatenate([y for _, y in dataset])) == sorted(labels)  # 40 of 40
    asked = tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=8,
                                training=False, num_parallel_reads=3, prefetch_batches=5)
    assert constant_inputs(asked, "PrefetchDataset") == [5]
    assert constant_inputs(asked, "ParallelInterleaveDatasetV4")[0] == 3
    first, again = (np.concatenate([y for _, y in asked]) for _ in range(2))
    assert sorted(first) == sorted(labels)
    np.testing.assert_array_equal(first, again)  # 3 shards interleaved, in a fixed order
    autotuned = tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=8,
                                    training=False, num_parallel_reads=100,
                                    prefetch_batches=tf.data.AUTOTUNE)
    assert constant_inputs(autotuned, "PrefetchDataset") == [tf.data.AUTOTUNE]
    assert constant_inputs(autotuned, "ParallelInterleaveDatasetV4")[0] == 20  # all the shards


def test_reader_decodes_at_most_prefetch_batches_ahead(tmp_path, monkeypatch):
    """Pauses that let the buffer fill, then bursts that drain it (as validation runs or
    checkpoints do): the reader never gets more than `prefetch_batches` and the batches being
    decoded ahead of the consumer (with tf.data.AUTOTUNE it grows with every drained
    burst)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(800, 6, 5, 3), dtype=np.uint8)
    tfmem.write_image_tfrecords((images, rng.integers(0, 3, 800)), str(tmp_path),
                                class_names=["a", "b", "c"], shard_size_mb=0.02, shuffle=False)
    decoded = []
    decode_fn = pipeline.decode_fn

    def counting_decode_fn(*args, **kwargs):
        decode_batch = decode_fn(*args, **kwargs)

        def counted(payloads, *locators):
            def tick(size):
                decoded.extend([1] * int(size))
                time.sleep(0.002 * int(size))  # decoding takes time: a burst drains the buffer
                return np.int64(0)

            size = tf.shape(payloads)[0]
            with tf.control_dependencies([tf.py_function(tick, [size], tf.int64)]):
                return decode_batch(payloads, *locators)

        return counted

    monkeypatch.setattr(pipeline, "decode_fn", counting_decode_fn)
    batch_size = 8
    dataset = tfmem.image_dataset(str(tmp_path), image_size=(6, 5), batch_size=batch_size,
                                  training=False)
    iterator, consumed, ahead = iter(dataset), 0, []
    for _ in range(8):
        time.sleep(0.4)
        ahead.append(len(decoded) - consumed * batch_size)
        for _ in range(8):
            next(iterator)
            consumed += 1
    del iterator  # stop the pipeline's py_function threads before the interpreter exits
    # 2 prefetched batches + those being decoded.
    assert max(ahead) <= (2 + pipeline.BATCHES_IN_FLIGHT) * batch_size, ahead


def test_numpy_input_errors_come_before_any_file(tmp_path):
    images, labels = _source(6)
    with pytest.raises(ValueError, match=r"Label 3 \(at index \d\; \d such labels\) is out of "
                                         r"range for 3 class names"):
        tfmem.write_image_tfrecords((images, labels + 1), tmp_path / "a",
                                    class_names=["x", "y", "z"])
    with pytest.raises(ValueError, match="Got 6 images but 5 labels"):
        tfmem.write_image_tfrecords((images, labels[:5]), tmp_path / "b")
    with pytest.raises(ValueError, match="uint8 array"):
        tfmem.write_image_tfrecords((images.astype(np.float32), labels), tmp_path / "c")
    assert os.listdir(tmp_path) == []


def test_existing_set_is_not_overwritten_silently(written, tmp_path):
    images, labels, _ = written
    tfmem.write_image_tfrecords((images[:4], labels[:4]), tmp_path)
    with pytest.raises(ValueError, match="already holds a TFRecord set.*overwrite=True"):
        tfmem.write_image_tfrecords((images[:4], labels[:4]), tmp_path)
    manifest = tfmem.write_image_tfrecords((images[:2], labels[:2]), tmp_path, overwrite=True)
    assert manifest.num_examples == 2 and len(os.listdir(tmp_path)) == 2  # old shard removed


def _stored_features(manifest):
    rows = []
    for record in tf.data.TFRecordDataset(manifest.files):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        rows.append({key: (f.int64_list.value or f.bytes_list.value)[0]
                     for key, f in feature.items()})
    return rows


def test_dataset_sources_raw_and_encoded(tmp_path):
    rng = np.random.default_rng(7)
    grey = rng.integers(0, 256, size=(5, 6), dtype=np.uint8)
    rgba = rng.integers(0, 256, size=(7, 3, 4), dtype=np.uint8)
    rgb = rng.integers(0, 256, size=(4, 9, 3), dtype=np.uint8)
    encoded = [tf.io.encode_png(grey[..., None]).numpy(), tf.io.encode_png(rgba).numpy(),
               tf.io.encode_jpeg(rgb).numpy()]
    # Encoded bytes (as tfds gives with SkipDecoding) are stored as given; shapes from headers.
    manifest = tfmem.write_image_tfrecords(
        tf.data.Dataset.from_tensor_slices((encoded, [0, 1, 2])), tmp_path / "encoded")
    rows = _stored_features(manifest)
    assert [r["image"] for r in rows] == encoded
    assert [(r["height"], r["width"], r["channels"]) for r in rows] == [(5, 6, 1), (7, 3, 4),
                                                                          (4, 9, 3)]
    assert manifest.class_names == ("0", "1", "2") and manifest.image_formats == ("jpeg", "png")
    # Raw uint8 images (dicts, as tfds without as_supervised) are encoded as lossless PNG.
    raw = tf.data.Dataset.from_tensors({"image": rgb, "label": 1}).repeat(2)
    manifest = tfmem.write_image_tfrecords(raw, tmp_path / "raw", class_names=["x", "y"])
    assert [tf.io.decode_png(r["image"]).numpy().tolist() for r in _stored_features(manifest)] == [
        rgb.tolist()] * 2
    with pytest.raises(ValueError, match=r"Label 1 of example 0 is out of range for 1 class"):
        tfmem.write_image_tfrecords(raw, tmp_path / "bad", class_names=["x"])
    assert not os.listdir(tmp_path / "bad")  # the partial shard was removed


def _write_image_folder(root):
    rng = np.random.default_rng(3)
    files = {}
    for name, encode in [("cats/a.png", tf.io.encode_png), ("cats/b.jpg", tf.io.encode_jpeg),
                         ("dogs/c.PNG", tf.io.encode_png), ("dogs/deep/d.jpeg", tf.io.encode_jpeg)]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        image = rng.integers(0, 256, size=(9, 7, 3), dtype=np.uint8)
        path.write_bytes(encode(image).numpy())
        files[name] = image
    (root / "LICENSE").write_text("root-level files are not examples")
    return files


def test_image_folder_is_stored_as_given(tmp_path):
    files = _write_image_folder(tmp_path / "photos")
    manifest = tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out")
    assert manifest.class_names == ("cats", "dogs") and manifest.num_examples == 4
    assert manifest.image_formats == ("jpeg", "png")
    stored = {}
    for record in tf.data.TFRecordDataset(manifest.files):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        stored[feature["id"].bytes_list.value[0].decode()] = (
            feature["image"].bytes_list.value[0], feature["label"].int64_list.value[0],
            [feature[k].int64_list.value[0] for k in ("height", "width", "channels")])
    assert set(stored) == set(files)
    for name in files:
        data, label, shape = stored[name]
        assert data == (tmp_path / "photos" / name).read_bytes()  # not re-encoded
        assert label == (0 if name.startswith("cats") else 1) and shape == [9, 7, 3]


def test_unreadable_file_is_named_or_skipped_and_counted(tmp_path):
    _write_image_folder(tmp_path / "photos")
    (tmp_path / "photos" / "dogs" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"Cannot read image '.*dogs/notes.txt'.*skip_unreadable"):
        tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    manifest = tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out2",
                                           skip_unreadable=True)
    assert manifest.skipped == ("dogs/notes.txt",) and manifest.num_examples == 4
    assert tfmem.read_manifest(tmp_path / "out2").skipped == ("dogs/notes.txt",)


def test_an_empty_class_folder_is_refused_or_kept_as_its_class(tmp_path):
    files = _write_image_folder(tmp_path / "photos")
    (tmp_path / "photos" / "ants").mkdir()  # sorted first: it would shift every label
    with pytest.raises(ValueError, match=r"1 class folder\(s\) of '.*photos' hold no images: "
                                         r"'ants'; .* allow_empty_classes=True "
                                         r"\(`--allow-empty-classes`\)"):
        tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.warns(UserWarning, match=r"hold no images: 'ants'; kept as classes without "
                                         r"examples"):
        manifest = tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out",
                                               allow_empty_classes=True)
    assert manifest.class_names == ("ants", "cats", "dogs")
    labels = {feature["id"].bytes_list.value[0].decode(): feature["label"].int64_list.value[0]
              for feature in (tf.train.Example.FromString(r.numpy()).features.feature
                              for r in tf.data.TFRecordDataset(manifest.files))}
    assert labels == {name: 1 if name.startswith("cats") else 2 for name in files}


def _written_in_a_thread(*args, **kwargs):
    """`write_image_tfrecords` in a thread: a write that would wait forever fails the test."""
    import threading

    outcome = {}

    def write():
        try:
            outcome["manifest"] = tfmem.write_image_tfrecords(*args, **kwargs)
        except ValueError as error:
            outcome["error"] = error

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert outcome, "the write hangs"
    return outcome


def test_fifos_and_broken_links_are_never_opened(tmp_path):
    _write_image_folder(tmp_path / "photos")
    os.mkfifo(tmp_path / "photos" / "cats" / "pipe.png")  # opening it would wait for a writer
    (tmp_path / "photos" / "dogs" / "gone.png").symlink_to(tmp_path / "deleted.png")
    refused = _written_in_a_thread(str(tmp_path / "photos"), tmp_path / "out")
    assert re.fullmatch(r"Cannot read image '.*cats/pipe\.png': not a regular file \(a FIFO, "
                        r"socket or device\): it was not opened\. .*skip_unreadable.*",
                        str(refused["error"]))
    assert not (tmp_path / "out").exists()
    os.remove(tmp_path / "photos" / "cats" / "pipe.png")
    refused = _written_in_a_thread(str(tmp_path / "photos"), tmp_path / "out")
    assert re.fullmatch(r"Cannot read image '.*dogs/gone\.png': it cannot be opened \(a "
                        r"symbolic link to nothing\): No such file or directory\. .*",
                        str(refused["error"]))
    os.mkfifo(tmp_path / "photos" / "cats" / "pipe.png")
    manifest = _written_in_a_thread(str(tmp_path / "photos"), tmp_path / "out",
                                    skip_unreadable=True)["manifest"]
    assert manifest.skipped == ("cats/pipe.png", "dogs/gone.png")
    assert manifest.num_examples == 4


def test_output_inside_the_folder_and_images_over_the_pixel_limit_are_refused(tmp_path):
    _write_image_folder(tmp_path / "photos")
    for output in (tmp_path / "photos", tmp_path / "photos" / "dogs" / "set"):
        with pytest.raises(ValueError, match=r"`output_dir` '.*' is inside the image folder "
                                             r"'.*photos' \(`--output` inside `--source`\)"):
            tfmem.write_image_tfrecords(str(tmp_path / "photos"), output)
    assert not (tmp_path / "photos" / "dogs" / "set").exists()
    # Each image is 9 × 7 = 63 pixels: over a limit of 62, known from the header alone.
    with pytest.raises(ValueError, match=r"Cannot read image '.*': its header says 7×9 = 63 "
                                         r"pixels, above the limit of 62 \(max_image_pixels, "
                                         r"`--max-image-pixels`\); it was not decoded"):
        tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out",
                                    max_image_pixels=62)
    manifest = tfmem.write_image_tfrecords(str(tmp_path / "photos"), tmp_path / "out",
                                           max_image_pixels=62, skip_unreadable=True,
                                           allow_empty_classes=True)
    assert (manifest.num_examples, len(manifest.skipped)) == (0, 4)


def test_missing_or_empty_inputs_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"Image folder '.*nowhere' does not exist"):
        tfmem.write_image_tfrecords(str(tmp_path / "nowhere"), tmp_path / "out")
    (tmp_path / "empty" / "cats").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"Found no images in '.*empty' \(class folders: \['cats"):
        tfmem.write_image_tfrecords(str(tmp_path / "empty"), tmp_path / "out")
    with pytest.raises(ValueError, match=r"Found no files matching the pattern '.*\*.tfrec'"):
        tfmem.image_dataset(str(tmp_path / "*.tfrec"), image_size=(8, 8), batch_size=2,
                            training=False)
    with pytest.raises(ValueError, match=r"No manifest.json at '.*empty/manifest.json'"):
        tfmem.read_manifest(tmp_path / "empty")


def test_interrupted_write_leaves_the_directory_as_it_was(tmp_path):
    images, labels = _source(30)
    directory = tmp_path / "set"
    seen = {}

    def interrupt(num_examples, num_bytes, total):
        if num_examples == 20:
            seen["files"] = sorted(os.listdir(directory))
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of a shard would

    with pytest.raises(KeyboardInterrupt):
        tfmem.write_image_tfrecords((images, labels), directory, shard_size_mb=0.003,
                                    progress=interrupt)
    # While writing, the open shard existed only under a hidden temporary name...
    temporary = [f for f in seen["files"] if f.startswith(".")]
    complete = [f for f in seen["files"] if not f.startswith(".")]
    assert len(temporary) == 1 and temporary[0].startswith(".shard-") and len(complete) >= 1
    # ...and afterwards this write's files are gone, finished shards included.
    assert os.listdir(directory) == []
    # A killed run (no chance to clean up) leaves shards without a manifest: refused...
    (directory / "shard-000000-00000.tfrecord").write_bytes(
        open(tfmem.write_image_tfrecords((images[:2], labels[:2]), tmp_path / "one").files[0],
             "rb").read())
    (directory / ".shard-000000-00001.tfrecord.tmp-999").write_bytes(b"half a shard")
    with pytest.raises(ValueError, match="holds tfmem shards but no manifest.json"):
        tfmem.image_dataset(str(directory), image_size=(4, 4), batch_size=2, training=False)
    # ...and removed by the next write into the directory.
    manifest = tfmem.write_image_tfrecords((images, labels), directory, overwrite=True)
    assert sorted(os.listdir(directory)) == sorted(
        ["manifest.json", *(shard.name for shard in manifest.shards)])


def _ids(dataset):
    return sorted(int(i) for _, ids in dataset for i in ids.numpy())


def test_auto_shard_policy_splits_files_or_records(written, tmp_path):
    images, labels, manifest = written
    policy = tf.data.experimental.AutoShardPolicy
    assert tfmem.auto_shard_policy(num_files=14, num_workers=2) == policy.FILE
    assert tfmem.auto_shard_policy(num_files=1, num_workers=3) == policy.DATA
    # FILE: 14 shards over 2 workers; worker i reads shards i, i + 2, ... whole.
    dataset = tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=1,
                                  training=False, schema=_unlabelled(), num_workers=2)
    assert dataset.options().experimental_distribute.auto_shard_policy == policy.FILE
    starts = np.cumsum([0] + [s.num_examples for s in manifest.shards])
    for worker in range(2):
        # _AutoShardDataset is the rewrite tf.distribute applies on each worker of a cluster.
        expected = [i for k in range(worker, len(manifest.shards), 2)
                    for i in range(starts[k], starts[k + 1])]
        assert _ids(_AutoShardDataset(dataset, 2, worker)) == expected
    # DATA: one shard, 3 workers; each reads it all and keeps every 3rd record.
    tfmem.write_image_tfrecords((images, labels), tmp_path, shuffle=False)
    dataset = tfmem.image_dataset(str(tmp_path), image_size=(4, 4), batch_size=1,
                                  training=False, schema=_unlabelled(), num_workers=3)
    assert dataset.options().experimental_distribute.auto_shard_policy == policy.DATA
    for worker in range(3):
        assert _ids(_AutoShardDataset(dataset, 3, worker)) == list(range(worker, NUM_EXAMPLES, 3))


@pytest.mark.parametrize("shards", [14, 1])  # more files than pipelines / fewer
def test_input_context_reads_a_disjoint_part_per_pipeline(written, tmp_path, shards):
    images, labels, manifest = written
    directory = manifest.directory
    if shards == 1:
        directory = str(tmp_path)
        tfmem.write_image_tfrecords((images, labels), directory, shuffle=False)
    parts = []
    for index in range(2):
        context = tf.distribute.InputContext(2, index, num_replicas_in_sync=2)
        dataset = tfmem.image_dataset(directory, image_size=(4, 4), batch_size=8,
                                      training=False, schema=_unlabelled(), input_context=context)
        assert dataset.element_spec[0].shape.as_list() == [None, 4, 4, 3]
        assert max(len(ids) for _, ids in dataset) == 4  # global batch 8 over 2 replicas
        parts.append(_ids(dataset))
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == list(range(NUM_EXAMPLES))


def test_mirrored_strategy_consumes_the_stream_on_two_cpus(written, two_cpu_strategy):
    images, labels, manifest = written
    strategy = two_cpu_strategy

    def dataset_fn(context):
        return tfmem.image_dataset(manifest.directory, image_size=(HEIGHT, WIDTH), batch_size=8,
                                   training=False, input_context=context)

    seen_labels, pixel_sum = [], 0.0
    for batch in strategy.distribute_datasets_from_function(dataset_fn):
        per_replica_x = strategy.experimental_local_results(batch[0])
        per_replica_y = strategy.experimental_local_results(batch[1])
        assert [x.shape[0] for x in per_replica_x] == [4, 4]
        assert {x.device.rsplit(":", 1)[-1] for x in per_replica_x} == {"0", "1"}
        seen_labels += [int(v) for y in per_replica_y for v in y]
        pixel_sum += sum(float(tf.reduce_sum(x)) for x in per_replica_x)
    assert sorted(seen_labels) == sorted(labels.tolist())
    assert pixel_sum == pytest.approx(float(images.astype(np.float64).sum()), rel=1e-6)

    # And a real fit under the strategy: one epoch, 40 / 8 = 5 optimizer steps.
    with strategy.scope():
        model = keras.Sequential([keras.Input((HEIGHT, WIDTH, 3)), keras.layers.Flatten(),
                                  keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = tfmem.image_dataset(manifest.directory, image_size=(HEIGHT, WIDTH), batch_size=8,
                                training=True, data_range=(0, 1))
    model.fit(train, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == NUM_EXAMPLES // 8


def test_bad_reader_arguments_say_what_is_expected(written):
    _, _, manifest = written
    with pytest.raises(ValueError, match=r"`data_range` must be one of \(\(0, 255\), \(0, 1\)\)"):
        tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=2, training=False,
                            data_range=(-1, 1))
    with pytest.raises(ValueError, match=r"has no labels.*training=False"):
        tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=2, training=True,
                            schema=_unlabelled())
    for bad in (0, 1.5):
        expected = r"`prefetch_batches` must be a positive int \(e.g. 2\) or tf.data.AUTOTUNE"
        with pytest.raises(ValueError, match=rf"{expected}, got {bad}\."):
            tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=2,
                                training=False, prefetch_batches=bad)
    with pytest.raises(ValueError, match=r"`num_parallel_reads` must be a positive int"):
        tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=2, training=False,
                            num_parallel_reads=0)
    for size in ((0, 0), (4,), (4, 4.5), 4):
        with pytest.raises(ValueError, match=r"`image_size` must be \(height, width\), two "
                                             rf"positive ints .*, got {re.escape(repr(size))}"):
            tfmem.image_dataset(manifest.directory, image_size=size, batch_size=2, training=False)
    for batch_size in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match=rf"`batch_size` must be a positive int .*, got "
                                             rf"{batch_size!r}"):
            tfmem.tfds_image_dataset("never-read", split="train", image_size=(4, 4),
                                     batch_size=batch_size, training=False)
    with pytest.raises(TypeError, match=r"image_dataset\(\) got unexpected keyword argument\(s\) "
                                        r"\['image_szie'\]"):
        tfmem.image_dataset(manifest.directory, image_szie=(4, 4), batch_size=2, training=False)
    with pytest.raises(TypeError, match=r"needs the keyword argument\(s\) \['training'\]"):
        tfmem.image_dataset(manifest.directory, image_size=(4, 4), batch_size=2)


def test_both_readers_list_the_same_options_with_one_set_of_defaults():
    options = {f.name: f.default for f in dataclasses.fields(tfmem.ReaderOptions)}
    for reader_function in (tfmem.image_dataset, tfmem.tfds_image_dataset):
        parameters = inspect.signature(reader_function).parameters
        assert {name: parameters[name].default for name in options} == {
            name: (inspect.Parameter.empty if default is dataclasses.MISSING else default)
            for name, default in options.items()}
    assert options["num_parallel_reads"] == 4 and options["prefetch_batches"] == 2
    assert tfmem.ReaderOptions(image_size=[8, 6], batch_size=4, training=True) == \
        tfmem.ReaderOptions(image_size=(8, 6), batch_size=4, training=True, drop_remainder=True)


def test_demo_set_is_deterministic_and_balanced(tmp_path):
    # Learnability is checked by tests/test_scripts_data.py, through the README's demo command.
    first = [image for image, _ in tfmem.demo_examples(8, image_size=32, seed=5)]
    again = [image for image, _ in tfmem.demo_examples(8, image_size=32, seed=5)]
    other = [image for image, _ in tfmem.demo_examples(8, image_size=32, seed=6)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not any(np.array_equal(a, b) for a, b in zip(first, other))
    manifest = tfmem.make_demo_dataset(tmp_path, num_examples=20, image_size=16, seed=5)
    assert manifest.num_examples == 20 and manifest.class_names == tfmem.DEMO_CLASS_NAMES
    images, labels = next(iter(tfmem.image_dataset(
        tmp_path, image_size=(16, 16), batch_size=20, training=False, num_parallel_reads=1)))
    expected = list(tfmem.demo_examples(20, image_size=16, seed=5))
    np.testing.assert_array_equal(images.numpy(), np.stack([x for x, _ in expected]))
    assert labels.numpy().tolist() == [y for _, y in expected] == [0, 1, 2, 3] * 5
