"""Search spaces: built-ins, genome identity, TOML files and their validation."""

import subprocess
import sys
from pathlib import Path

import pytest

from towerlab.errors import UserError
from towerlab.config import CUSTOM_MODEL, MODELS
from towerlab.search import BUILTIN_SPACES, Space, canonical, genome_hash, load_space
from towerlab.search.space import check_genes, gene_rules


def test_search_and_store_never_import_torch():
    code = ("import towerlab.search, towerlab.search.work.worker, towerlab.search.store, towerlab.search.samplers.tpe, sys; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mlp_is_the_original_space():
    space = load_space("mlp")
    assert space.model == "mlp"
    assert space.genes == {
        "neurons": (64, 128, 256, 512, 768, 1024),
        "layers": (1, 2, 3, 4),
        "activation": ("relu", "elu", "tanh", "sigmoid"),
        "optimizer": ("rmsprop", "adam", "sgd", "adagrad", "adadelta", "adamax", "nadam"),
    }
    assert space.size == 672


def test_cnn_space():
    space = load_space("cnn")
    assert space.model == "cnn"
    assert list(space.genes) == ["blocks", "filters", "kernel_size", "dense", "dropout", "lr", "batch_size"]
    assert space.genes["dropout"] == (0.0, 0.25, 0.5)
    assert space.size == 3 * 3 * 2 * 3 * 3 * 3 * 3


@pytest.mark.parametrize("name", sorted(BUILTIN_SPACES))
def test_builtins_obey_the_gene_schema(name):
    space = BUILTIN_SPACES[name]
    assert check_genes(space.model, {k: list(v) for k, v in space.genes.items()}, name) == space.genes


def test_all_genomes_is_every_genome_once_in_a_fixed_order():
    space = load_space("mlp")
    genomes = list(space.all_genomes())
    assert len(genomes) == space.size == len({genome_hash(g) for g in genomes})
    assert genomes == list(space.all_genomes())
    assert genomes[0] == {"neurons": 64, "layers": 1, "activation": "relu", "optimizer": "rmsprop"}
    assert genomes[1]["optimizer"] == "adam"  # the last gene varies fastest
    assert all(space.genome_at(i) == g for i, g in enumerate(genomes))
    assert all(space.contains(g) for g in genomes)
    with pytest.raises(IndexError):
        space.genome_at(space.size)


def test_contains_checks_names_values_and_types():
    space = Space("s", "mlp", {"layers": (1, 2), "activation": ("relu",)})
    assert space.contains({"activation": "relu", "layers": 2})
    assert not space.contains({"layers": 2})
    assert not space.contains({"layers": 3, "activation": "relu"})
    assert not space.contains({"layers": True, "activation": "relu"})  # True == 1, but not an int gene value
    assert not space.contains({"layers": 1.0, "activation": "relu"})
    assert not space.contains({"layers": 1, "activation": "relu", "neurons": 64})


def test_canonical_genome_ignores_key_order():
    a = {"neurons": 64, "activation": "relu"}
    b = {"activation": "relu", "neurons": 64}
    assert canonical(a) == canonical(b) == '{"activation":"relu","neurons":64}'
    assert genome_hash(a) == genome_hash(b)
    assert len(genome_hash(a)) == 64
    assert genome_hash(a) != genome_hash({"activation": "relu", "neurons": 128})


def test_fingerprint_is_the_content_not_the_name(tmp_path):
    path = tmp_path / "copy.toml"
    path.write_text('model = "mlp"\n[genes]\nneurons = [64, 128, 256, 512, 768, 1024]\nlayers = [1, 2, 3, 4]\n'
                    'activation = ["relu", "elu", "tanh", "sigmoid"]\n'
                    'optimizer = ["rmsprop", "adam", "sgd", "adagrad", "adadelta", "adamax", "nadam"]\n')
    copy = load_space(path)
    assert copy.name == str(path)
    assert copy.fingerprint == load_space("mlp").fingerprint
    base = Space("a", "mlp", {"layers": (1, 2), "neurons": (64,)})
    assert Space("b", "mlp", {"layers": (1, 2), "neurons": (64,)}).fingerprint == base.fingerprint
    assert Space("a", "cnn", {"layers": (1, 2), "neurons": (64,)}).fingerprint != base.fingerprint
    assert Space("a", "mlp", {"layers": (2, 1), "neurons": (64,)}).fingerprint != base.fingerprint
    assert Space("a", "mlp", {"neurons": (64,), "layers": (1, 2)}).fingerprint != base.fingerprint


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def test_toml_space(tmp_path):
    path = write(tmp_path, 'model = "cnn"\n[genes]\nblocks = [1, 2]\ndropout = [0, 0.5]\n'
                           'optimizer = ["adam"]\nlr = [1e-3, 3e-3]\n')
    space = load_space(str(path))
    assert space.model == "cnn"
    assert space.genes == {"blocks": (1, 2), "dropout": (0.0, 0.5), "optimizer": ("adam",), "lr": (0.001, 0.003)}
    assert type(space.genes["dropout"][0]) is float  # a float gene written as an int is a float
    assert space.size == 8  # a single-valued gene is fixed


@pytest.mark.parametrize("text, message", [
    ('model = "mlp"\nseed = 3\n[genes]\nlayers = [1]\n', "unknown key(s) seed"),
    ('model = "rnn"\n[genes]\nlayers = [1]\n', "unknown model 'rnn'"),
    ('[genes]\nlayers = [1]\n', "missing model"),
    ('model = 3\n[genes]\nlayers = [1]\n', "model must be a string"),
    ('model = "mlp"\n[genes]\nfilters = [16]\n', "unknown gene 'filters' for model mlp"),
    ('model = "mlp"\n[genes]\nlayers = 2\n', "gene 'layers' must be a non-empty list"),
    ('model = "mlp"\n[genes]\nlayers = []\n', "gene 'layers' must be a non-empty list"),
    ('model = "mlp"\n[genes]\nlayers = ["two"]\n', "gene 'layers' has value 'two', expected an int >= 1"),
    ('model = "mlp"\n[genes]\nlayers = [1.0]\n', "gene 'layers' has value 1.0"),
    ('model = "mlp"\n[genes]\nlayers = [true]\n', "gene 'layers' has value True"),
    ('model = "mlp"\n[genes]\nneurons = [0]\n', "gene 'neurons' has value 0"),
    ('model = "mlp"\n[genes]\nactivation = ["relu", "gelu"]\n', "one of relu, elu, tanh, sigmoid"),
    ('model = "mlp"\n[genes]\noptimizer = ["lbfgs"]\n', "gene 'optimizer' has value 'lbfgs'"),
    ('model = "cnn"\n[genes]\nblocks = [5]\n', "expected an int in [1, 4]"),
    ('model = "cnn"\n[genes]\nkernel_size = [3, 4]\n', "expected an odd int >= 1"),
    ('model = "cnn"\n[genes]\ndropout = [1.0]\n', "expected a number in [0, 1)"),
    ('model = "cnn"\n[genes]\ndropout = ["half"]\n', "gene 'dropout' has value 'half'"),
    ('model = "cnn"\n[genes]\nlr = [0]\n', "expected a number > 0"),
    ('model = "cnn"\n[genes]\nlr = [nan]\n', "gene 'lr' has value nan"),
    ('model = "mlp"\n[genes]\nlayers = [1, 2, 1]\n', "lists 1 twice"),
    ('model = "cnn"\n[genes]\ndropout = [0, 0.0]\n', "lists 0.0 twice"),
    ('model = "mlp"\n[genes]\n', "no genes"),
    ('model = "mlp"\n', "no genes"),
    ('model = "mlp"\ngenes = [1, 2]\n', "genes must be a table"),
    ('model = "mlp"\n[genes\nlayers = [1]\n', "is not valid TOML"),
])
def test_bad_space_files_name_the_file_and_the_problem(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_space(str(path))
    assert message in str(err.value)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_list_holds_true_beside_1_and_false_beside_0(tmp_path):
    """issue 50: [8, 1, true] "listed True twice" (1 == True in Python); in a genome they are two values."""
    space = load_space(str(write(tmp_path, 'model = "custom"\n[genes]\nflag = [8, 1, true, 0, false]\n')))
    assert space.genes["flag"] == (8, 1, True, 0, False) and space.size == 5
    with pytest.raises(UserError, match="lists True twice"):
        load_space(str(write(tmp_path, 'model = "custom"\n[genes]\nflag = [true, 1, true]\n')))


def test_a_space_file_with_a_byte_order_mark_loads_and_a_json_space_names_a_key_given_twice(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'model = "mlp"\n[genes]\nlayers = [1, 2]\n')
    assert load_space(str(path)).genes == {"layers": (1, 2)}
    with pytest.raises(UserError, match="gives the key 'layers' twice in one object"):
        load_space('{"model": "mlp", "genes": {"layers": [1], "layers": [2]}}')


def test_missing_or_unreadable_space_file(tmp_path):
    with pytest.raises(UserError, match="unknown search space 'nope.toml': use mlp, cnn, whitenet or the path"):
        load_space("nope.toml")
    with pytest.raises(UserError, match=f"cannot read search space {tmp_path}"):
        load_space(tmp_path)  # a folder
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe model")
    with pytest.raises(UserError, match="not valid TOML"):
        load_space(binary)


def test_every_schema_gene_can_be_loaded(tmp_path):
    examples = {"neurons": "[64]", "layers": "[2]", "activation": '["elu"]', "blocks": "[4]",
                "filters": "[32]", "kernel_size": "[5]", "dense": "[128]", "dropout": "[0.25]",
                "optimizer": '["nadam"]', "lr": "[0.1]", "batch_size": "[32]", "epochs": "[3]",
                "label_smoothing": "[0.2]", "width1": "[64]", "width2": "[256]", "width3": "[256]", "depth": "[3]"}
    for model, (rules, _) in ((m, gene_rules(m, m)) for m in (*MODELS, CUSTOM_MODEL)):
        body = "".join(f"{gene} = {examples[gene]}\n" for gene in rules)
        space = load_space(write(tmp_path, f'model = "{model}"\n[genes]\n{body}'))
        assert list(space.genes) == list(rules) and space.size == 1
