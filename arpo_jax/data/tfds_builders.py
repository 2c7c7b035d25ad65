"""The tensorflow-datasets route (`data.source = "tfds"`): reference RL parquet -> array_record, read back with
`tfds.data_source` (random access, no TensorFlow needed; verified with tensorflow-datasets 4.9.10).

One TFDS dataset config per parquet file, named after the file and the hash of its bytes, so a changed file gets
a fresh build and an unchanged one is prepared once and reused. Each record stores the raw parquet row as JSON:
the reference files differ in their struct fields (e.g. `extra_info.need_tools_kwargs`, `reward_model.style`),
and malformed rows must reach the same validation as the parquet route so both report the same `skipped` rows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence

from arpo_jax.data.sources import parquet_records

DATASET_NAME = "arpo_rl_parquet"
SPLIT = "train"  # one split per config: the whole file (train/valid/test is the file's role, not a TFDS split)


def available() -> bool:
    """Whether tensorflow-datasets and array_record are importable."""
    try:
        import array_record  # noqa: F401
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> None:
    if not available():
        raise ValueError("data.source='tfds' needs tensorflow-datasets and array-record "
                         "(`pip install tensorflow-datasets array-record`; TensorFlow itself is not needed); "
                         "or use data.source='parquet'")


def default_data_dir() -> str:
    """$TFDS_DATA_DIR when set, else a per-user cache (the reference data folders are read-only)."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "arpo_jax", "tfds")


def file_digest(path: str) -> str:
    """First 12 hex digits of the file's sha256: the config name changes exactly when the content does."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def config_name(path: str) -> str:
    """A valid TFDS config name for a parquet file: its stem plus its content digest."""
    stem = re.sub(r"[^A-Za-z0-9_]", "_", os.path.splitext(os.path.basename(path))[0])
    return f"{stem}_{file_digest(path)}"


@functools.lru_cache(maxsize=1)
def builder_class():
    """The builder class, created on first use so that importing this module does not import tfds."""
    import numpy as np
    import tensorflow_datasets as tfds

    class ArpoRlParquet(tfds.core.GeneratorBasedBuilder):
        """Reference-schema RL parquet (spec 2.1), one config per file; records keep the raw row as JSON."""

        VERSION = tfds.core.Version("1.0.0")
        # Nothing is downloaded. Also sidesteps a tfds 4.9.10 bug: looking up the checksums file of a builder
        # defined inside a package imports `importlib_resources`, which tfds does not install on Python >= 3.9.
        url_infos = None

        def __init__(self, *, parquet_file: str = "", **kwargs):
            self._parquet_file = parquet_file
            super().__init__(**kwargs)

        def _info(self):
            features = tfds.features.FeaturesDict({
                "row": np.int64,  # row number in the parquet file
                "record": tfds.features.Text(),  # the parquet row as JSON (bytes kept, \x08 included)
            })
            # disable_shuffling: read order = parquet row order, as with the parquet route.
            return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True,
                                         description="ARPO/AEPO reference RL parquet rows")

        def _split_generators(self, dl_manager):
            del dl_manager  # local file, nothing to download
            return {SPLIT: self._generate_examples()}

        def _generate_examples(self):
            for _, row, record in parquet_records([self._parquet_file]):
                yield row, {"row": row, "record": json.dumps(record, ensure_ascii=False, default=str)}

    return ArpoRlParquet


def prepare(parquet_file: str, data_dir: str = "") -> tuple[str, str]:
    """Builds the array_record dataset of one parquet file unless it exists; returns (name/config, data_dir)."""
    _require()
    import tensorflow_datasets as tfds

    data_dir = data_dir or default_data_dir()
    name = config_name(parquet_file)
    config = tfds.core.BuilderConfig(name=name, description=f"rows of {os.path.abspath(parquet_file)}")
    builder = builder_class()(parquet_file=parquet_file, config=config, data_dir=data_dir,
                              file_format="array_record")
    builder.download_and_prepare()  # a no-op when this config was built before (tfds checks the folder)
    return f"{DATASET_NAME}/{name}", data_dir


def tfds_records(files: Sequence[str], data_dir: str = "") -> Iterator[tuple[str, int, dict]]:
    """(file, row, record) like `sources.parquet_records`, read through `tfds.data_source`."""
    _require()
    import tensorflow_datasets as tfds

    for f in files:
        name, directory = prepare(f, data_dir)
        source = tfds.data_source(name, data_dir=directory, split=SPLIT, download=False)
        for i in range(len(source)):
            ex = source[i]
            yield f, int(ex["row"]), json.loads(ex["record"])
