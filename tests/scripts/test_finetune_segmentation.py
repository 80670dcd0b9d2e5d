"""scripts/finetune.py on segmentation sets, in this process: non-square sizes and the size of
the set by default, the per-pixel losses."""

import dataclasses
import json
import re

import numpy as np
import keras
import pytest
import tensorflow as tf

import tfmem
from tfmem.finetune import attempt, outputs
from tfmem.finetune.config import FinetuneConfig
from tfmem.finetune.data_facts import DataFacts
from tfmem.metrics.segmentation import MultiLabelIoU
from tfmem.training.segmentation_losses import DiceLoss


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Tiny demo shapes with masks: 8 of 32×48 (U-Net takes it), 4 of 32×40 (it does not)."""
    directory = tmp_path_factory.mktemp("segmentation-sets")
    wide = tfmem.make_demo_dataset(directory / "wide", num_examples=8, image_size=(32, 48),
                                   task="segmentation")
    odd = tfmem.make_demo_dataset(directory / "odd", num_examples=4, image_size=(32, 40),
                                  task="segmentation")
    # Kaggle's cloud layout: run-length-encoded masks whose classes overlap (one channel each).
    (directory / "images").mkdir()
    for name in ("a.png", "b.png"):
        (directory / "images" / name).write_bytes(
            tf.io.encode_png(np.full((32, 32, 3), 99, np.uint8)).numpy())
    (directory / "clouds.csv").write_text(
        "Image_Label,EncodedPixels\na.png_Fish,1 40\na.png_Sugar,20 50\nb.png_Fish,\n"
        "b.png_Sugar,3 9\nb.png_Gravel,100 7\n")
    clouds = tfmem.write_image_tfrecords((directory / "images", directory / "clouds.csv"),
                                         directory / "clouds")
    # DeepLab-layout records without a manifest: two files of 32×48 (JPEG, PNG), and a 32×40
    # file beside a 64×64 one.
    foreign = {"deeplab": [((32, 48), "jpeg"), ((32, 48), "png")],
               "mixed": [((32, 40), "png"), ((64, 64), "png")]}
    for name, files in foreign.items():
        (directory / name).mkdir()
        for number, (size, encoding) in enumerate(files):
            with tf.io.TFRecordWriter(str(directory / name / f"train-{number}.tfrecord")) as w:
                for image, mask in tfmem.demo_examples(2, size, seed=number,
                                                       task="segmentation"):
                    w.write(_deeplab_example(image, mask, encoding))
    return {"wide": wide.directory, "odd": odd.directory, "clouds": clouds.directory,
            "deeplab": str(directory / "deeplab"), "mixed": str(directory / "mixed"),
            "mixed_odd": str(directory / "mixed" / "train-0.tfrecord")}


def _deeplab_example(image, mask, encoding):
    def feature(data):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))

    encode = tf.io.encode_png if encoding == "png" else tf.io.encode_jpeg
    return tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": feature(encode(image).numpy()),
        "image/format": feature(encoding.encode()),
        "image/segmentation/class/encoded": feature(tf.io.encode_png(mask[..., None]).numpy()),
        "image/segmentation/class/format": feature(b"png"),
    })).SerializeToString()


def test_the_manifest_records_the_size_its_images_share(sets):
    assert tfmem.read_manifest(sets["wide"]).image_size == (32, 48)


def test_without_image_size_a_run_takes_the_size_of_its_set(sets):
    spec = tfmem.models.spec("unet")
    data = DataFacts.of(FinetuneConfig(model="unet", data=sets["wide"]), spec)
    assert data.image_size == (32, 48)
    # run.json records a pair for a non-square size, one number for a square one.
    assert outputs.run_settings(FinetuneConfig(), spec, "float32", data)["image_size"] == [32, 48]
    given = DataFacts.of(FinetuneConfig(model="unet", data=sets["wide"], image_size="64"), spec)
    assert given.image_size == (64, 64)
    assert outputs.run_settings(FinetuneConfig(), spec, "float32", given)["image_size"] == 64
    # Through the supervisor's JSON (a list) the size is a pair again.
    assert DataFacts(**json.loads(json.dumps(dataclasses.asdict(data)))) == data
    assert FinetuneConfig(image_size=[360, 480]).image_size == (360, 480)


def test_records_without_a_manifest_train_at_the_size_of_their_first_images(sets, capsys):
    spec = tfmem.models.spec("unet")
    config = FinetuneConfig(model="unet", data=sets["deeplab"], num_classes=5,
                            task="segmentation")
    data = DataFacts.of(config, spec)
    assert (data.image_size, data.num_examples) == ((32, 48), 4)
    assert data.size_source == (f"the size of the images of --data {sets['deeplab']}, from "
                                "its first records")
    # Images of several sizes: the model's size, and a line saying why.
    mixed = DataFacts.of(dataclasses.replace(config, data=sets["mixed"]), spec)
    assert mixed.image_size == (spec.default_image_size,) * 2
    assert mixed.size_source == "the training size of unet"
    assert capsys.readouterr().out == (
        f"finetune: the first images of --data {sets['mixed']} differ in size (32×40, "
        f"64×64); training at the size of unet, {spec.default_image_size}: pass --image-size "
        "to choose\n")


def test_loss_picks_dice_with_the_ignore_value_of_the_set(sets):
    data = DataFacts.of(FinetuneConfig(model="unet", data=sets["wide"]), tfmem.models.spec("unet"))
    loss, (metric,) = attempt.loss_and_metrics(data, "cross-entropy+dice")
    assert isinstance(loss, DiceLoss) and loss.cross_entropy and not loss.multi_label
    assert loss.ignore_class == data.ignore_value == 255 and loss.num_classes == 5
    assert isinstance(metric, keras.metrics.MeanIoU) and metric.ignore_class == 255
    loss, _ = attempt.loss_and_metrics(data, "dice")
    assert isinstance(loss, DiceLoss) and not loss.cross_entropy


def test_a_multi_label_set_trains_a_sigmoid_per_class(sets):
    spec = tfmem.models.spec("unet")
    config = FinetuneConfig(model="unet", data=sets["clouds"])
    data = DataFacts.of(config, spec)
    assert data.multi_label and data.task == "segmentation" and data.num_classes == 3
    loss, (metric,) = attempt.loss_and_metrics(data)
    assert isinstance(loss, keras.losses.BinaryCrossentropy)
    assert isinstance(metric, MultiLabelIoU) and metric.num_classes == 3
    loss, _ = attempt.loss_and_metrics(data, "dice")
    assert isinstance(loss, DiceLoss) and loss.multi_label and loss.ignore_class is None
    model, _ = attempt._build(config, spec, tfmem.detect(), data)
    assert model.output_shape == (None, 32, 32, 3)
    assert model.layers[-1].activation is keras.activations.sigmoid


@pytest.mark.parametrize("args, message", [
    (["--image-size", "0"], r"--image-size '0' is not a size: pass one number for square "
                            r"images \(--image-size 224\) or height,width \(--image-size "
                            r"360,480\)"),
    (["--image-size", "32,48,3"], r"--image-size '32,48,3' is not a size"),
    (["--model", "unet", "--data", "{odd}"],
     r"--image-size 32,40 \(the size of the images of --data .*odd, from its manifest; none "
     r"given\): unet needs height and width divisible by 16 .* Try 32 or 48\. Pass "
     r"--image-size HEIGHT,WIDTH that it takes"),
    (["--model", "unet", "--data", "{mixed_odd}", "--num-classes", "5", "--task",
      "segmentation"],
     r"--image-size 32,40 \(the size of the images of --data .*train-0\.tfrecord, from its "
     r"first records; none given\): unet needs height and width divisible by 16"),
    (["--model", "unet", "--data", "{wide}", "--image-size", "32,40"],
     r"--image-size 32,40: unet needs height and width divisible by 16"),
    (["--loss", "dice"], r"--loss dice scores masks, and this run is classification \(a "
                         r"label per image\); leave --loss out, or pass --task segmentation"),
    (["--loss", "focal"], r"flag --loss=focal: value should be one of "),
])
def test_a_bad_size_or_loss_is_one_line_naming_the_flag(finetune_cli, sets, tmp_path, args,
                                                      message):
    args = [arg.format(**sets) for arg in args]
    status, _, stderr = finetune_cli("--output", str(tmp_path / "run"), *args)
    assert status == 2, stderr
    assert re.fullmatch(rf"error: {message}.*\n", stderr, flags=re.S), stderr
    assert stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_under_a_memory_limit_a_segmentation_run_is_planned_with_its_loss(sets, tmp_path):
    # What the --memory-limit supervisor plans for a limit (`supervisor._plan_under`): a dry
    # run of the training process's plan for that budget, writing the split it would take.
    # With 64 classes the loss's tensors (per pixel: 64 probabilities, their gradient, the
    # log-probabilities) outgrow the backward's workspace, so the loss has a row of its own.
    config = FinetuneConfig(model="unet", data=sets["deeplab"], num_classes=64,
                            task="segmentation", global_batch_size=8, dry_run=True,
                            allow_over_budget=True, output=str(tmp_path / "run"))
    data = DataFacts.of(config, tfmem.models.spec("unet"))
    loss, metrics = attempt.loss_and_metrics(data)
    with tfmem.models.shapes_only():
        model = tfmem.models.build("unet", num_classes=64, image_size=(32, 48))
    planned = tfmem.plan(model, global_batch_size=8, memory_budget=2**40, loss=loss,
                         metrics=metrics)
    assert planned.loss_row_bytes_per_sample > 0
    # A limit that one step of 8 fits without the loss's row, and not with it.
    without = planned.peak_bytes(8, 1) - 8 * planned.loss_row_bytes_per_sample
    limit = int((without + planned.peak_bytes(8, 1)) / 2 / planned.safety)
    split_file = tmp_path / "split.json"
    attempt.run_attempt(config, attempt.Attempt("auto", plan_budget=limit, memory_limit=limit,
                                                split_file=str(split_file)))
    split = json.loads(split_file.read_text())
    expected = tfmem.plan(model, global_batch_size=8, memory_budget=limit, loss=loss,
                          metrics=metrics)
    assert (split["micro_batch_size"], split["accumulation_steps"]) == (
        expected.micro_batch_size, expected.accumulation_steps)
    assert expected.micro_batch_size < 8 and split["nothing_fits"] is None
    assert expected.replace(loss_bytes_per_sample=0).micro_batch_size == 8  # without the row
