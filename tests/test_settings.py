"""kvstore.Settings: the one home of every store default and its check, read
by KVStore, by `kvstore serve`'s options and by the command line's."""

import argparse
import dataclasses
import re

import pytest

import kvstore
from kvstore import settings
from kvstore.settings import BadSetting, Settings

from kvhelpers import make_tensors


def test_every_setting_has_a_default_a_check_and_a_doc():
    for f in dataclasses.fields(Settings):
        assert f.metadata["doc"], f.name
        assert callable(f.metadata["check"]), f.name
        # The default passes its own check.
        assert f.metadata["check"](f.name, f.default) == f.default, f.name
    assert Settings() == settings.DEFAULT_SETTINGS


@pytest.mark.parametrize("name, value, message", [
    ("budget_mb", -1, "budget_mb=-1 must be >= 0"),
    ("budget_mb", float("nan"), "budget_mb=nan is not a finite number"),
    ("block_tokens", 0, "block_tokens=0 must be a positive u32"),
    ("model_id", 256, "model_id=256 is outside 0..255"),
    ("quant_bits", 7, "quant_bits=7 is not a quant width"),
    ("ctx_size", 0, "ctx_size=0 must be a positive u32"),
    ("layout", "flat", "layout='flat' is not one of chain, whole"),
    ("kv_codec", "zip", "kv_codec='zip' is not one of raw, lossless, q8, q4"),
    ("max_write_mb_per_hour", 0, "max_write_mb_per_hour=0"),
    ("max_age_s", -5, "max_age_s=-5 must be >= 0"),
    ("min_tokens", -3, "min_tokens=-3 must be >= 0"),
    ("max_pinned_share", 1.5, "max_pinned_share=1.5 must be between 0 and 1"),
])
def test_a_bad_value_is_refused_naming_the_setting_and_the_value(name, value, message):
    with pytest.raises(BadSetting, match=re.escape(message)) as e:
        Settings(**{name: value})
    assert e.value.name == name and isinstance(e.value, ValueError)


@pytest.mark.parametrize("name, value", [("durable", 1), ("min_tokens", "512"), ("budget_mb", "8"),
                                         ("block_tokens", 2.5), ("verify", None)])
def test_a_value_of_the_wrong_type_is_a_type_error_naming_it(name, value):
    with pytest.raises(TypeError, match=f"{name}="):
        Settings(**{name: value})


def test_every_codec_goes_with_every_layout():
    for codec in ("raw", "lossless", "q8", "q4"):
        for layout in ("chain", "whole"):
            s = Settings(kv_codec=codec, layout=layout)
            assert (s.kv_codec, s.layout) == (codec, layout)
    with pytest.raises(BadSetting, match="kv_codec='zip'"):
        Settings(kv_codec="zip", layout="whole")


def test_settings_are_frozen_and_replace_checks_again():
    s = Settings(min_tokens=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.min_tokens = 2
    assert s.replace(block_tokens=64).block_tokens == 64 and s.replace(block_tokens=64).min_tokens == 1
    with pytest.raises(BadSetting, match="block_tokens=0"):
        s.replace(block_tokens=0)
    with pytest.raises(TypeError, match="'block_token' is not a setting \\(did you mean 'block_tokens'\\?\\)"):
        s.replace(block_token=64)


def test_a_store_takes_settings_and_changes_over_them(tmp_path):
    base = Settings(min_tokens=1, durable=False, block_tokens=64)
    with kvstore.KVStore(tmp_path / "a", base, layout="whole") as s:
        assert s.settings == base.replace(layout="whole")
        text = "x" * 100
        assert s.save(text, list(range(100)), make_tensors(100)) is not None     # min_tokens=1 holds
    with kvstore.KVStore(tmp_path / "b", min_tokens=1, durable=False) as s:
        assert s.settings.min_tokens == 1 and s.settings.layout == "chain"


def test_a_bad_setting_fails_before_the_directory_is_made(tmp_path):
    with pytest.raises(BadSetting, match="budget_mb=-1"):
        kvstore.KVStore(tmp_path / "never", budget_mb=-1)
    with pytest.raises(TypeError, match="'budget_gb' is not a setting"):
        kvstore.KVStore(tmp_path / "never", budget_gb=1)
    with pytest.raises(TypeError, match="is not a kvstore.Settings"):
        kvstore.KVStore(tmp_path / "never", {"min_tokens": 1})
    assert not (tmp_path / "never").exists()


def test_options_are_made_from_the_fields_with_their_defaults():
    p = argparse.ArgumentParser()
    defaults = Settings(min_tokens=64)
    settings.add_arguments(p, ["min_tokens", "layout", "stale_after_s", "budget_mb"], defaults)
    text = " ".join(p.format_help().split())
    assert "--min-tokens N" in text and "(default 64)" in text
    assert "{chain,whole}" in text and "(default chain)" in text
    assert "--stale-after-days DAYS" in text and "(default 30)" in text       # shown in the option's unit
    assert "10% of the filesystem holding it" in text

    got = settings.from_arguments(p.parse_args([]), ["min_tokens", "layout", "stale_after_s"], defaults)
    assert got == defaults                                                     # nothing given: the defaults
    got = settings.from_arguments(p.parse_args(["--stale-after-days", "0", "--layout", "whole"]),
                                  ["min_tokens", "layout", "stale_after_s"], defaults)
    assert got.stale_after_s is None and got.layout == "whole" and got.min_tokens == 64
    with pytest.raises(BadSetting, match="^--min-tokens -1 must be >= 0$"):
        settings.from_arguments(p.parse_args(["--min-tokens", "-1"]), ["min_tokens"], defaults)


def test_serves_store_options_are_the_settings():
    from kvstore.serve import options
    p = options.build_parser()
    text = " ".join(p.format_help().split())
    for name, flag in settings.flags(options.STORE_SETTINGS).items():
        assert flag in text, flag
    opts, _ = p.parse_known_args(["--model", ".", "--min-tokens", "100", "--waypoint-tokens", "0",
                                  "--max-pin-ttl", "5m"])
    assert options.check(opts) is None
    assert opts.settings == options.SERVE_DEFAULTS.replace(min_tokens=100, continued_interval_tokens=0,
                                                           max_pin_ttl_s=300)
    # Serve's own default: a pin's lifetime is cut to an hour.
    opts, _ = p.parse_known_args(["--model", "."])
    assert options.check(opts) is None and opts.settings.max_pin_ttl_s == 3600
    opts, _ = p.parse_known_args(["--model", ".", "--block-tokens", "0"])
    assert options.check(opts) == "--block-tokens 0 must be a positive u32"


def test_kvstore_import_checks_its_options_as_the_store_does(tmp_path, capsys):
    from kvstore.cli import main
    f = tmp_path / "one.kv"
    f.write_bytes(b"")
    assert main(["import", str(f), "--dir", str(tmp_path / "d"), "--block-tokens", "0"]) == 2
    assert "--block-tokens 0 must be a positive u32" in capsys.readouterr().err
    assert main(["stats", str(tmp_path), "--budget-mb", "-5"]) == 2
    assert "--budget-mb -5.0 must be >= 0" in capsys.readouterr().err


def test_the_guide_lists_every_setting_with_its_default_and_doc():
    import pathlib
    guide = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide.md").read_text()
    rows = {name: (default, doc) for name, default, doc in
            re.findall(r"^\| `(\w+)` \| ([^|]+) \| (.*) \|$", guide, re.M)}
    for name, default, doc in settings.describe():
        assert name in rows, f"docs/guide.md has no row for the setting {name}"
        assert rows[name][0].strip() == settings.shown(default), (name, rows[name][0])
        assert rows[name][1].strip() == doc, f"docs/guide.md's row for {name} is not the field's doc"
