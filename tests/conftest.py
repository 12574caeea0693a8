import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo.data import synthetic as syn
from mlx_kvlingo.models.pair import load_model, load_pair

import pytest
from helpers import known_answer_target, with_new_head


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Tiny offline model folders shared by the whole test session."""
    d = tmp_path_factory.mktemp("tiny")
    tok = syn.build_tokenizer(d / "tokenizer")
    folders = {
        "tokenizer": tok,
        "qwen3": syn.make_model_folder(d / "qwen3", "qwen3", tok, seed=0),
        "qwen3_moe": syn.make_model_folder(d / "qwen3_moe", "qwen3_moe", tok, seed=1),
        "llama": syn.make_model_folder(d / "llama", "llama", tok, seed=2),
        "qwen2": syn.make_model_folder(d / "qwen2", "qwen2", tok, seed=3),
    }
    answer = known_answer_target(folders["qwen3"], d / "known", seed=4)
    folders["known"] = d / "known"
    folders["qwen3_head"] = with_new_head(folders["qwen3"], d / "qwen3_head")
    folders["known_answer"] = answer
    folders["root"] = d
    return folders


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """Real local text (the standard library's sources) for calibration tests."""
    p = tmp_path_factory.mktemp("data") / "stdlib.txt"
    p.write_text(syn.training_text())
    return p


@pytest.fixture(scope="session")
def models(tiny_dir):
    """Loaded tiny models (a test module may override this with its own selection)."""
    return {k: load_model(tiny_dir[k]) for k in ("qwen3", "known", "qwen3_moe")}


@pytest.fixture(scope="session")
def known_pair(models):
    return load_pair(models["qwen3"], models["known"])


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """The known-answer pair (tests that need another pair define their own `pair`)."""
    return load_pair(tiny_dir["qwen3"], tiny_dir["known"])


@pytest.fixture(scope="module")
def translators(pair, tiny_dir):
    """Exact forward and backward translators of the known-answer pair."""
    from helpers import exact_translator, inverse

    answer = tiny_dir["known_answer"]
    return exact_translator(pair, answer), exact_translator(pair.reversed(), inverse(answer))


@pytest.fixture(autouse=True, scope="session")
def _own_retention_folder(tmp_path_factory):
    """What `kvlingo eval --task content` stores for reader auto goes to a folder of this run's
    own (the cache folder's models stay shared): a test's few tasks never steer another's auto."""
    from mlx_kvlingo.conversation import reader

    mp = pytest.MonkeyPatch()
    mp.setattr(reader, "RETENTION", tmp_path_factory.mktemp("retention"))  # an absolute path
    yield
    mp.undo()
