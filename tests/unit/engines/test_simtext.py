"""The sim's deterministic text, lengths, seeds and prompt counts."""

from __future__ import annotations

from bourse.engines.simtext import (
    ANSWER_LENGTH_MAX,
    ANSWER_LENGTH_MIN,
    VOCABULARY,
    answer_length,
    count_prompt_tokens,
    natural_length,
    seed_of,
    sim_tokens,
)


def test_vocabulary_is_plain_words_without_duplicates() -> None:
    assert len(VOCABULARY) >= 200
    assert len(set(VOCABULARY)) == len(VOCABULARY)
    assert all(word.isalpha() for word in VOCABULARY)


def test_tokens_are_deterministic_and_read_as_text() -> None:
    tokens = sim_tokens(42, 20)
    assert tokens == sim_tokens(42, 20)
    assert tokens != sim_tokens(43, 20)
    assert len(tokens) == 20
    assert not tokens[0].startswith(" ")
    assert all(t.startswith(" ") and t[1:] in VOCABULARY for t in tokens[1:])
    assert "".join(tokens).split() == [t.strip() for t in tokens]


def test_a_shorter_draw_is_a_prefix_of_a_longer_one() -> None:
    assert sim_tokens(7, 30)[:10] == sim_tokens(7, 10)
    assert sim_tokens(7, 0) == []


def test_answer_length_is_seeded_and_capped() -> None:
    lengths = {natural_length(seed) for seed in range(500)}
    assert min(lengths) == ANSWER_LENGTH_MIN
    assert max(lengths) == ANSWER_LENGTH_MAX
    assert natural_length(5) == natural_length(5)
    assert answer_length(5, 1000) == natural_length(5)
    assert answer_length(5, 3) == 3


def test_chat_prompt_count() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello there  world"}, {"type": "image_url"}],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
        ]
    }
    assert count_prompt_tokens("chat", body) == (2 + 4) + (3 + 4) + (0 + 4) + 2
    assert count_prompt_tokens("chat", {"messages": []}) == 2


def test_completion_prompt_count() -> None:
    assert count_prompt_tokens("completion", {"prompt": "one two three"}) == 4
    assert count_prompt_tokens("completion", {"prompt": ["one two"]}) == 3
    assert count_prompt_tokens("completion", {"prompt": ""}) == 1


def test_seed_of_prefers_the_request_seed() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert seed_of({"seed": 9, "messages": messages}) == 9
    assert seed_of({"seed": True, "messages": messages}) == seed_of({"messages": messages})
    assert seed_of({"seed": "9", "messages": messages}) == seed_of({"messages": messages})


def test_seed_of_hashes_the_prompt_stably() -> None:
    a = {"messages": [{"role": "user", "content": "hi"}]}
    b = {"messages": [{"content": "hi", "role": "user"}]}
    c = {"messages": [{"role": "user", "content": "hello"}]}
    assert seed_of(a) == seed_of(b)
    assert seed_of(a) != seed_of(c)
    assert seed_of({"prompt": "x"}) == seed_of({"prompt": "x"}) != seed_of({"prompt": "y"})
