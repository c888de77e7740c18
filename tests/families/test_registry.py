"""What the family registry promises (library/families/registry.py and entry.py, docs/adding_a_family.md), for every
entry in ENTRIES: a tiny builder whose folder loads back as that family, shipped configs that parse for a model of
it, a docs page the README links, network modules the config schema accepts, and detectors no other entry shares."""
from __future__ import annotations

from pathlib import Path

import pytest

from library.config import parse_config
from library.config.network_args import NETWORK_MODULES
from library.config.option_types import Option, to_bool
from library.config.options import CORE_OPTIONS, OPTIONS, add_family_options
from library.families.entry import Ref
from library.families.loading import load_components
from library.families.registry import ENTRIES, entry_for, file_options, network_modules, tiny_models
from tests.helpers import REPO
from tests.helpers.runs import shipped_data_args

BY_NAME = {entry.name: entry for entry in ENTRIES}
TINY = [(entry.name, tiny.name) for entry in ENTRIES for tiny in entry.tiny]
TINY_FILES = [(entry.name, tiny.name) for entry in ENTRIES for tiny in entry.tiny if tiny.save_files]
CONFIGS = [(entry.name, name) for entry in ENTRIES for name in entry.configs]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """Each tiny builder's folder (seed 0) and the separate files its --files writes: tiny name -> (folder,
    {file option or part: path}). A few MB in all, built in a second or two."""
    root = tmp_path_factory.mktemp("registry")
    models = {}
    for name, tiny in tiny_models().items():
        folder = Path(tiny.save(root / name, 0, False))
        models[name] = (folder, tiny.save_files(folder, root / f"{name}-files") if tiny.save_files else {})
    return models


def test_names_are_unique_and_one_entry_reads_what_no_other_recognises():
    assert len(BY_NAME) == len(ENTRIES)
    assert len(tiny_models()) == len(TINY)  # the tiny builders' --family names, across families
    assert len([entry for entry in ENTRIES if entry.reads_unrecognised]) == 1


def test_the_schema_is_the_core_options_and_what_the_entries_declare_tagged_with_who_reads_them():
    declared: dict[str, list[str]] = {}
    for entry in ENTRIES:
        for option in entry.options:
            declared.setdefault(option.name, []).append(entry.name)
    assert set(OPTIONS) == set(CORE_OPTIONS) | set(declared)
    assert not set(CORE_OPTIONS) & set(declared), "a family redeclares a core option"
    assert {name: list(OPTIONS[name].families) for name in declared} == declared
    assert all(not option.families for option in CORE_OPTIONS.values())
    assert list(OPTIONS).index("v2") < list(OPTIONS).index("train_data_dir"), "family options leave their group"


def test_an_option_declared_twice_differently_is_refused_and_the_schema_is_kept():
    before = dict(OPTIONS)
    with pytest.raises(ValueError, match="clip_skip"):
        add_family_options("other", [Option("clip_skip", to_bool, False, "another meaning", group="model")])
    with pytest.raises(ValueError, match="no group"):
        add_family_options("other", [Option("new_option", to_bool, False, "no group")])
    assert OPTIONS == before


def test_the_registry_loads_no_model_code_and_every_ref_resolves():
    # The configuration is read before torch and diffusers are imported (train_network.hide_unused_packages).
    import subprocess
    import sys

    code = ("import sys, library.families.registry as r; "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    refs = [value for entry in ENTRIES for value in vars(entry).values() if isinstance(value, Ref)]
    refs += [value for entry in ENTRIES for tiny in entry.tiny for value in vars(tiny).values()
             if isinstance(value, Ref)]
    assert len(refs) >= 4 * len(ENTRIES)
    assert all(callable(ref.resolve()) for ref in refs)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.name)
def test_each_entry_has_a_tiny_builder_a_shipped_config_and_a_docs_page_the_readme_links(entry):
    assert entry.tiny, f"{entry.name}: no tiny builder"
    assert entry.configs, f"{entry.name}: no example config in configs/"
    assert entry.docs and (REPO / entry.docs).is_file(), f"{entry.name}: docs page {entry.docs!r} missing"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"]({entry.docs}" in readme, "not in the README's table"
    offered = next(line for line in readme.splitlines() if "python -m library.families.tiny FOLDER --family" in line)
    assert all(tiny.name in offered.split("--family ")[1].split("`")[0].split("|") for tiny in entry.tiny), offered
    assert set(entry.file_options) <= {option.name for option in entry.options if option.is_path}


@pytest.mark.parametrize("family, tiny", TINY, ids=[tiny for _, tiny in TINY])
def test_each_tiny_folder_loads_back_as_its_family(family, tiny, built):
    folder, _ = built[tiny]
    assert entry_for(folder) is BY_NAME[family]
    components = load_components(folder)
    assert type(components.family).__module__.startswith(f"library.families.{family}.")
    assert components.denoiser is not None and components.vae is not None and components.text_encoders


@pytest.mark.parametrize("family, tiny", TINY, ids=[tiny for _, tiny in TINY])
def test_each_tiny_folder_is_recognised_by_its_own_entry_alone(family, tiny, built):
    folder, _ = built[tiny]
    assert [entry.name for entry in ENTRIES if entry.is_folder(folder)] == [family]


@pytest.mark.parametrize("family, tiny", TINY_FILES, ids=[tiny for _, tiny in TINY_FILES])
def test_each_tiny_transformer_file_is_recognised_by_its_own_entry_alone(family, tiny, built):
    # The entry that reads unrecognised files takes any file no other entry claims (its reader says what it is),
    # so exclusivity is between the others. The separate text-encoder and autoencoder files are no model's file.
    _, files = built[tiny]
    recognised = {part: [entry.name for entry in ENTRIES if not entry.reads_unrecognised and entry.is_file(path)]
                  for part, path in files.items()}
    assert recognised == {part: [] if part in file_options() else [family] for part in files}
    assert any(part not in file_options() for part in files), "no transformer file written"
    assert set(BY_NAME[family].file_options) <= set(files), "--files leaves out a file the model is loaded with"


def test_an_sd_single_file_is_claimed_by_no_transformer_family(tmp_path):
    from library.families.sd.tiny import save_tiny_sd1_single_file

    path = save_tiny_sd1_single_file(tmp_path / "sd1.safetensors")
    assert [entry.name for entry in ENTRIES if not entry.reads_unrecognised and entry.is_file(path)] == []
    assert entry_for(path).reads_unrecognised


@pytest.mark.parametrize("family, name", CONFIGS, ids=[name for _, name in CONFIGS])
def test_each_shipped_config_parses_for_a_model_of_its_family(family, name, built, sample_data_dir, tmp_path):
    # As tests/integration/test_cli.py's check of every config: the paths point at the user's files, so the model
    # and data are this family's tiny folder and the quickstart images; everything else must pass as written.
    path = REPO / "configs" / name
    assert path.is_file(), f"{family} names {name}, which is not in configs/"
    folder, _ = built[BY_NAME[family].tiny[0].name]
    config, notes = parse_config(["--config", str(path), "--pretrained_model_name_or_path", str(folder),
                                  *shipped_data_args(path, sample_data_dir), "--output_dir", str(tmp_path)])
    assert config.network_module in BY_NAME[family].network_modules + NETWORK_MODULES
    assert all("no effect" in note for note in notes), notes


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda entry: entry.name)
def test_each_network_module_is_one_the_config_schema_accepts(entry):
    assert set(entry.network_modules) <= set(OPTIONS["network_module"].choices)


def test_the_schemas_network_modules_are_kohyas_own_and_the_registered_ones():
    assert set(OPTIONS["network_module"].choices) == set(NETWORK_MODULES) | set(network_modules())
