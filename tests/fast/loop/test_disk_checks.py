"""The disks before Ray starts (``rl_plugin.loop.disk_checks.check_output_dirs``): directories
created, an unwritable one refused naming its flag, and a ``--save`` disk too small for one
checkpoint (12 bytes per parameter of ``--hf-checkpoint``, counted from the safetensors headers)."""

from __future__ import annotations

import json
import shutil
import struct
from types import SimpleNamespace

import pytest

from rl_plugin.errors import RLArgumentError
from rl_plugin.loop.disk_checks import check_output_dirs


def _run(output_dir, save=None, hf_checkpoint=None):
    """The fields of a ``RunConfig`` that the check reads."""
    return SimpleNamespace(
        output_dir=output_dir,
        checkpoint=SimpleNamespace(save=save),
        train=SimpleNamespace(model=SimpleNamespace(hf_checkpoint=hf_checkpoint)),
    )


def _safetensors_header(directory, **shapes):
    """A ``model.safetensors`` of headers only (the count reads no tensor)."""
    directory.mkdir(parents=True, exist_ok=True)
    header = {name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]} for name, shape in shapes.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_directories_are_created_and_probed(tmp_path):
    check_output_dirs(_run(str(tmp_path / "out" / "a"), save=str(tmp_path / "ckpt" / "b")))
    assert (tmp_path / "out" / "a").is_dir() and (tmp_path / "ckpt" / "b").is_dir()
    assert list((tmp_path / "out" / "a").iterdir()) == [] and list((tmp_path / "ckpt" / "b").iterdir()) == []
    check_output_dirs(_run(str(tmp_path / "only_out")))  # no --save: only the output directory
    assert (tmp_path / "only_out").is_dir()


def test_an_unwritable_directory_is_refused_naming_its_flag(tmp_path):
    (tmp_path / "a_file").write_text("x")
    bad = str(tmp_path / "a_file" / "save")  # below a regular file: cannot be created
    with pytest.raises(RLArgumentError) as err:
        check_output_dirs(_run(str(tmp_path / "out"), save=bad))
    msg = str(err.value)
    assert msg.startswith(f"--save {bad}: the run cannot write there (") and "Not a directory" in msg, msg
    assert msg.endswith(
        "Fix: point --save at a writable directory (checked before Ray starts, so nothing was trained yet)."
    )
    with pytest.raises(RLArgumentError, match=r"^--output-dir .*a_file/out: the run cannot write there"):
        check_output_dirs(_run(str(tmp_path / "a_file" / "out")))


def test_a_save_disk_too_small_for_one_checkpoint_is_refused_in_mib(tmp_path):
    hf = tmp_path / "hf"
    free = shutil.disk_usage(tmp_path).free
    params = free // 12 + 2**20  # 12 bytes each: just over the free space
    _safetensors_header(hf, **{"w.weight": (params,)})
    save = str(tmp_path / "ckpt")
    with pytest.raises(RLArgumentError) as err:
        check_output_dirs(_run(str(tmp_path / "out"), save=save, hf_checkpoint=str(hf)))
    msg = str(err.value)
    free_now = shutil.disk_usage(save).free  # the message's number, read just after
    need_mib = 12 * params / 2**20
    assert msg.startswith(f"--save {save}: its file system has "), msg
    assert (
        f"and one checkpoint of {hf} needs about {need_mib:.1f} MiB (fp32 weights and AdamW's two moments, 12 bytes per parameter)"
        in msg
    )
    assert abs(float(msg.split(" has ")[1].split(" MiB")[0]) - free_now / 2**20) < 64  # other writers aside
    assert msg.endswith("Fix: free space there or point --save at a larger disk.")
    _safetensors_header(hf, **{"w.weight": (4, 8), "b": (8,)})  # 40 parameters: fits
    check_output_dirs(_run(str(tmp_path / "out"), save=save, hf_checkpoint=str(hf)))
