"""Arguments canonicalisation: how the core tells an imperfect echo from a rewritten call."""

from gateway.providers.arguments import arguments_object, arguments_text, canonical_arguments, normalize_arguments, same_arguments

MODEL = '{"description": "Write hi", "command": "echo hi > hello.txt", "opts": {"b": 1, "a": [1, 2]}}'


def test_reordered_and_compacted_echoes_are_the_same_call():
    reordered = '{"command": "echo hi > hello.txt", "opts": {"a": [1, 2], "b": 1}, "description": "Write hi"}'
    compact = '{"description":"Write hi","command":"echo hi > hello.txt","opts":{"b":1,"a":[1,2]}}'
    assert same_arguments(MODEL, reordered) and same_arguments(MODEL, compact)
    assert same_arguments(MODEL, {"command": "echo hi > hello.txt", "description": "Write hi", "opts": {"a": [1, 2], "b": 1}})
    assert canonical_arguments(MODEL) == '{"command":"echo hi > hello.txt","description":"Write hi","opts":{"a":[1,2],"b":1}}'


def test_different_values_are_different_calls():
    assert not same_arguments(MODEL, MODEL.replace("Write hi", "Write ho"))
    assert not same_arguments('{"a": [1, 2]}', '{"a": [2, 1]}')  # list order is meaning
    assert not same_arguments("{}", '{"a": null}')


def test_unicode_is_not_escaped_and_broken_json_compares_as_text():
    assert canonical_arguments('{"s": "h\\u00e9"}') == '{"s":"hé"}'
    assert same_arguments("{oops ", "{oops")
    assert not same_arguments("{oops", "{oops}")


def test_normalize_keeps_key_order_and_one_spacing():
    assert normalize_arguments('{"b":1,"a":"é"}') == '{"b": 1, "a": "é"}'
    assert normalize_arguments({"b": 1, "a": 2}) == '{"b": 1, "a": 2}'
    assert normalize_arguments("not json") == "not json" and normalize_arguments(None) == "{}"


def test_object_views_for_anthropic_and_gemini():
    assert arguments_object(MODEL)["opts"] == {"b": 1, "a": [1, 2]}
    assert arguments_object("") == {}
    assert arguments_object("[1, 2]") == {"_unparsed_arguments": "[1, 2]"}
    assert arguments_object("{bad") == {"_unparsed_arguments": "{bad"}
    assert arguments_text(MODEL) == MODEL and arguments_text("") == "{}"
    assert arguments_text("{bad") == '{"_unparsed_arguments": "{bad"}'
