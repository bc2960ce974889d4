"""`SequenceBatch`: sequences at different positions, on their own caches, stepping through one
forward pass get exactly the logits each gets alone, in every family and cache kind."""

import mlx.core as mx
import pytest
from families import FAMILIES, pair
from test_loading import CONFIG, random_model

import turbospark_mlx as ts
from turbospark_mlx.cache.batch import SequenceBatch

QWEN2 = dict(CONFIG, model_type="qwen2", attention_bias=True)  # biased K projections


def models():
    yield "llama", random_model(CONFIG)
    yield "qwen2", random_model(QWEN2)
    for family in FAMILIES:
        yield family, pair(family)[1]


@pytest.mark.parametrize("kv", ["fp16", "tq4", "k8v4"])
def test_batched_steps_equal_each_sequence_alone(kv):
    for family, model in models():
        vocab = model.args.vocab_size
        prompts = [mx.random.randint(0, vocab, (1, n)) for n in (5, 11, 3)]
        alone = [ts.make_cache(model, kv=kv, max_rows=16) for _ in prompts]
        batched = [ts.make_cache(model, kv=kv, max_rows=16) for _ in prompts]
        for p, a, b in zip(prompts, alone, batched):
            model(p, cache=a)
            model(p, cache=b)
        for m in (1, 1, 3, 1):  # one-token steps and a 3-row chunk, at each sequence's own position
            tokens = mx.random.randint(0, vocab, (len(prompts), m))
            expect = mx.concatenate([model(tokens[i : i + 1], cache=c) for i, c in enumerate(alone)])
            got = model(tokens, cache=SequenceBatch(batched))
            assert mx.array_equal(got, expect).item(), (family, kv, m)
        assert [c.offset for c in batched] == [c.offset for c in alone] == [11, 17, 9]


def test_sequence_batch_refuses_mixed_caches():
    model = random_model(CONFIG)
    with pytest.raises(ValueError, match="one per cache"):
        SequenceBatch([ts.make_cache(model, kv="tq4", batch_size=2)])
    other = random_model(dict(CONFIG, num_key_value_heads=4))
    with pytest.raises(ValueError, match="another model"):
        SequenceBatch([ts.make_cache(model), ts.make_cache(other)])
    with pytest.raises(ValueError, match="at least one"):
        SequenceBatch([])
