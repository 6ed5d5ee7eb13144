"""The text pipeline (jax_seqpar.data): corpus, tokenizers, Grain batches, exact resume,
per-process sharding.  No devices: processes are simulated by arguments."""

import json

import numpy as np
import pytest

pytest.importorskip("grain")
pytest.importorskip("tokenizers")

from jax_seqpar.data import (ByteTokenizer, DataConfig, KEYS, PackingReport,  # noqa: E402
                             load_tokenizer, make_documents, make_iterator, pack_documents,
                             text_files, tokenize_folder, train_bpe, write_corpus)
from jax_seqpar.data.tokenize import tokenize_files  # noqa: E402
from jax_seqpar.data.text_tokenizer import TextTokenizer  # noqa: E402

S, B = 256, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_corpus(d, 24, seed=3, median_chars=1200)
    return d


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_bpe((p.read_text() for p in text_files(corpus)), 400)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def drain(it):
    return list(it)


# --------------------------------------------------------------------------- corpus
def test_corpus_is_deterministic_small_and_varied(tmp_path):
    a, b = make_documents(seed=0), make_documents(seed=0)
    assert a == b and a != make_documents(seed=1)
    paths = write_corpus(tmp_path)
    sizes = [p.stat().st_size for p in paths]
    assert len(paths) == 48 and sum(sizes) < 300_000
    assert min(sizes) < 500 and max(sizes) > 8000  # log-normal lengths
    assert [p.read_text() for p in paths] == a
    for text in a:  # every fact is asked again at the end, with its answer
        facts = [ln for ln in text.splitlines() if ln.startswith("The ") and " is " in ln]
        asked = text.split("Questions.\n")[1].splitlines()
        assert len(facts) == len(asked) >= 2


# --------------------------------------------------------------------------- tokenizers
def test_bpe_is_deterministic_and_round_trips(corpus, tokenizer):
    texts = [p.read_text() for p in text_files(corpus)]
    again = train_bpe(texts, 400)
    assert again.tokenizer.to_str() == tokenizer.tokenizer.to_str()
    assert (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == \
        (400, 0, 1, 2)
    for text in texts[:5] + ["héllo — 日本語\n\t  x", ""]:
        ids = tokenizer.encode(text)
        assert ids.dtype == np.int32 and tokenizer.decode(ids) == text
    assert sum(map(len, tokenizer.encode_batch(texts))) < sum(map(len, texts)) / 2
    byte = ByteTokenizer()
    assert byte.decode(byte.encode("héllo 日本")) == "héllo 日本"
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, 100)


def test_tokenizer_json_with_its_config_loads_without_adding_specials(tmp_path, tokenizer):
    from tokenizers.processors import TemplateProcessing
    tokenizer.save(tmp_path / "model")
    loaded = load_tokenizer(tmp_path / "model")
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 0)
    assert load_tokenizer(tmp_path / "model" / "tokenizer.json").bos_id == 1
    text = "The colour of Taveni is morulo."
    np.testing.assert_array_equal(loaded.encode(text), tokenizer.encode(text))
    # a checkpoint's tokenizer whose post-processor adds BOS: encode() still adds nothing
    tok = loaded.tokenizer
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    hf = load_tokenizer(tmp_path / "model")
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (1, 2, None)
    assert hf.encode(text)[0] != 1
    (tmp_path / "model" / "tokenizer_config.json").write_text('{"eos_token": "<|eot|>"}')
    with pytest.raises(ValueError, match="eos_token='<\\|eot\\|>'"):
        load_tokenizer(tmp_path / "model")
    with pytest.raises(ValueError, match="no such tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
    ByteTokenizer().save(tmp_path / "bytes")
    assert isinstance(load_tokenizer(tmp_path / "bytes"), ByteTokenizer)


def test_chat_template_is_saved_read_back_and_rendered(tmp_path, tokenizer):
    """A tokenizer's chat template survives save / load (so a fine-tuned model's exported
    tokenizer keeps its base model's), in every form transformers writes it."""
    pytest.importorskip("jinja2")
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    chat = TextTokenizer(tokenizer.tokenizer, bos_id=1, eos_id=2, pad_id=0,
                         chat_template=template)
    messages = [{"role": "user", "content": "Where is Taveni?"}]
    want = "<s>user: Where is Taveni?</s><s>assistant:"
    assert chat.render_chat(messages) == want
    assert chat.render_chat(messages, add_generation_prompt=False).endswith("</s>")
    chat.save(tmp_path / "a")
    loaded = load_tokenizer(tmp_path / "a")
    assert loaded.chat_template == template and loaded.render_chat(messages) == want
    # a list of named templates (the one named "default"), or chat_template.jinja beside
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "no"},
                               {"name": "default", "template": template}]
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tmp_path / "a").chat_template == template
    (tmp_path / "a" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(tmp_path / "a").render_chat(messages) == "Where is Taveni?"
    # none: render_chat says so; a template that is not a string is refused by name
    tokenizer.save(tmp_path / "b")
    plain = load_tokenizer(tmp_path / "b")
    assert plain.chat_template is None
    assert "chat_template" not in json.loads((tmp_path / "b" /
                                              "tokenizer_config.json").read_text())
    with pytest.raises(ValueError, match="no chat template"):
        plain.render_chat(messages)
    with pytest.raises(TypeError, match="chat_template must be a string"):
        TextTokenizer(tokenizer.tokenizer, chat_template=[template])


def test_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        text_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="no files matching"):
        text_files(tmp_path)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="bad.txt is not UTF-8"):
        tokenize_folder(tmp_path, "bytes")


# --------------------------------------------------------------------------- pipeline
def test_one_epoch_in_order_equals_pack_documents(corpus, tokenizer):
    """No shuffle, one epoch: the Grain pipeline gives exactly pack_documents' batches,
    windows, padding rows and report."""
    it = make_iterator(corpus, seq_len=S, batch_size=B, tokenizer=tokenizer, shuffle=False,
                       num_epochs=1, window=7, process_index=0, process_count=1)
    got = drain(it)
    docs = tokenize_files(text_files(corpus), tokenizer)
    want = pack_documents(docs, S, batch_size=B, window=7, bos_id=1, eos_id=2)
    assert_same(got, list(want.batches))
    assert it.report == want.report
    assert it.report.tokens == sum(d.size + 2 for d in docs)
    assert all(b[k].shape == (B, S) for b in got for k in KEYS)


def test_deterministic_for_a_seed_and_every_epoch_complete(corpus, tokenizer):
    kw = dict(seq_len=S, batch_size=B, tokenizer=tokenizer, window=10, num_epochs=2,
              process_index=0, process_count=1)
    a, b = drain(make_iterator(corpus, seed=5, **kw)), drain(make_iterator(corpus, seed=5, **kw))
    assert_same(a, b)
    c = drain(make_iterator(corpus, seed=6, **kw))
    assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))
    docs = tokenize_files(text_files(corpus), tokenizer)
    tokens = np.concatenate([x["tokens"][x["loss_mask"]] for x in a])
    want = np.concatenate([np.concatenate([[1], d, [2]]) for d in docs])
    np.testing.assert_array_equal(np.bincount(tokens, minlength=400),
                                  2 * np.bincount(want, minlength=400))


@pytest.mark.parametrize("num_epochs, policy", [(None, "best_fit"), (2, "sequential")])
def test_resume_is_exact(corpus, tokenizer, num_epochs, policy):
    """Take k batches, save the state (through JSON), take more; a fresh iterator restored
    from the state gives the same continuation, for k inside a window, at a window's
    end and in the padded tail of a finite run."""
    kw = dict(seq_len=S, batch_size=B, tokenizer=tokenizer, window=6, seed=1, policy=policy,
              num_epochs=num_epochs, process_index=0, process_count=1)
    total = 40 if num_epochs is None else len(drain(make_iterator(corpus, **kw)))
    reference = take(make_iterator(corpus, **kw), total)
    rows = set()
    for k in sorted({0, 1, 3, total // 2, total - 1}):
        it = make_iterator(corpus, **kw)
        assert_same(take(it, k), reference[:k])
        state = json.loads(json.dumps(it.get_state()))
        rows.add(state["row"] > 0)
        report = it.report
        rest = reference[k:]
        assert_same(take(it, len(rest)), rest)
        fresh = make_iterator(corpus, **kw)
        fresh.set_state(state)
        assert_same(take(fresh, len(rest)), rest)
        assert fresh.report == it.report and report.tokens <= it.report.tokens
        if num_epochs is not None:
            assert drain(fresh) == [] and drain(it) == []
    assert rows == {False, True}, "states both inside a window and between windows"


def test_resume_through_grains_checkpoint_handler(tmp_path, corpus, tokenizer):
    grain = pytest.importorskip("grain")
    from etils import epath
    kw = dict(seq_len=S, batch_size=B, tokenizer=tokenizer, seed=2, window=12,
              process_index=0, process_count=1)
    it = make_iterator(corpus, **kw)
    take(it, 5)
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path), item=it)
    want = take(it, 4)
    fresh = grain.checkpoint.CheckpointHandler().restore(
        epath.Path(tmp_path), item=make_iterator(corpus, **kw))
    assert_same(take(fresh, 4), want)


def test_processes_get_their_rows_of_the_same_global_batch(corpus, tokenizer):
    kw = dict(seq_len=S, batch_size=B, tokenizer=tokenizer, window=8, seed=4)
    one = take(make_iterator(corpus, process_index=0, process_count=1, **kw), 10)
    for P in (2, 4):
        parts = [take(make_iterator(corpus, process_index=p, process_count=P, **kw), 10)
                 for p in range(P)]
        for step, whole in enumerate(one):
            assert all(parts[p][step]["tokens"].shape == (B // P, S) for p in range(P))
            assert_same([{k: np.concatenate([parts[p][step][k] for p in range(P)])
                          for k in KEYS}], [whole])


def test_document_sharding_splits_the_documents(corpus, tokenizer):
    kw = dict(seq_len=S, batch_size=B, tokenizer=tokenizer, window=5, shuffle=False,
              num_epochs=1, shard="documents", process_count=2)
    its = [make_iterator(corpus, process_index=p, **kw) for p in range(2)]
    batches = [drain(it) for it in its]
    docs = tokenize_files(text_files(corpus), tokenizer)
    for p in range(2):
        assert all(b["tokens"].shape == (B // 2, S) for b in batches[p])
        want = pack_documents(docs[p::2], S, batch_size=B // 2, window=5, bos_id=1, eos_id=2)
        assert_same(batches[p], list(want.batches))
    assert its[0].report.documents + its[1].report.documents == len(docs)


def test_default_tokenizer_is_a_bpe_trained_on_the_corpus(corpus):
    it = make_iterator(corpus, seq_len=S, batch_size=2, window=24)  # jax: one process
    assert it.tokenizer.vocab_size == 512 and it.tokenizer.bos_id == 1
    batch = next(it)
    assert batch["tokens"].max() < 512
    assert it.report.efficiency > 0.9, it.report.summary()
    byte = make_iterator(corpus, seq_len=S, batch_size=2, tokenizer="bytes", window=4,
                         process_index=0, process_count=1)
    assert next(byte)["tokens"].max() < 258 and byte.tokenizer.bos_id == 256


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=3, process_index=0, process_count=2), "multiple of process_count=2"),
    (dict(process_index=2, process_count=2), "process_index=2"),
    (dict(window=0), "window"),
    (dict(num_epochs=0), "num_epochs"),
    (dict(seed=-1), "seed"),
    (dict(shard="hosts"), "shard"),
    (dict(policy="random"), "policy"),
    (dict(seq_len=0), "seq_len"),
])
def test_bad_pipeline_arguments_name_themselves(corpus, kwargs, match):
    kw = dict(seq_len=S, batch_size=B, tokenizer="bytes", process_index=0, process_count=1)
    with pytest.raises(ValueError, match=match):
        make_iterator(corpus, **{**kw, **kwargs})


def test_a_state_from_another_seq_len_is_refused(corpus):
    kw = dict(batch_size=B, tokenizer="bytes", process_index=0, process_count=1)
    state = make_iterator(corpus, seq_len=S, **kw).get_state()
    with pytest.raises(ValueError, match="seq_len=256"):
        make_iterator(corpus, seq_len=128, **kw).set_state(state)
    assert DataConfig(64, 2).pack_options(ByteTokenizer()).bos_id == 256
    assert PackingReport.from_dict(state["report"]).seq_len == S
