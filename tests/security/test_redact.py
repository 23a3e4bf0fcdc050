"""gateway/redact.py: what is scrubbed, what is left alone, and where placeholders sit in token ids."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.canonical import ChatRequest, Message, ToolCall
from gateway.redact import PLACEHOLDER, RedactConfig, Redactor, placeholder_spans, token_decoder

AWS_ID = "AKIAQ7EXAMPLE4SECRET"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # 40 characters
BEARER = "eyJhbGciOiJIUzI1NiJ9-opaque-token-77f1c2"
SAMPLES = {
    "aws_access_key": f"aws_access_key_id = {AWS_ID}",
    "aws_secret_key": f"aws_secret_access_key = {AWS_SECRET}",
    "anthropic_key": "ANTHROPIC says: sk-ant-api03-abcdefghijklmnopqrstuvwxyz012345",
    "openai_key": "key sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234",
    "google_api_key": "url?key=AIzaSyA1234567890abcdefghijklmnopqrstuv",
    "github_token": "token ghp_abcdefghijklmnopqrstuvwxyz0123456789AB",
    "bearer": f"curl -H 'Authorization: Bearer {BEARER}' https://api",
    "env_secret": "DATABASE_PASSWORD=hunter2hunter2\n",
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nIBAAK\n-----END RSA PRIVATE KEY-----",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "config_secret": "db:\n  password: hunter2hunter2\n",
    "json_secret": '{"user": "ci", "apiKey": "AbCdEf123456xyz"}',
    "url_credentials": "DATABASE_URL is postgres://admin:s3cr3t-pw@db.internal:5432/app",
    "npm_token": "//registry.npmjs.org/:_authToken=npm_abcdefghijklmnopqrstuvwxyz0123456789",
    "basic_auth": "curl -H 'Authorization: Basic dXNlcjpwYXNzd29yZA==' https://api",
}
BENIGN = [
    "def get_password(user):\n    return db.lookup(user)\n",
    "SECRET_KEY = os.environ.get('SECRET_KEY')\n",
    "API_TOKEN=${API_TOKEN}\n",
    "The bearer of this letter is trusted.",
    "sk-short",
    "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "git commit 4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    "PASSWORD_MIN_LENGTH: 8",
    "Use Bearer authentication for the API.",  # prose, not a token (it was scrubbed before)
    "self.password = password\n",
    "token: Optional[str] = None\n",
    "  password: string;\n",
    "password: SecretStr = Field(...)\n",
    "token = tokenizer.encode(text)\n",
    "db_password = os.environ['DB_PASSWORD']\n",
    '{"eos_token": "<|im_end|>", "mask_token": "[MASK]", "max_tokens": 100000}',
    "max_tokens: 100000\n",
    "token: ${{ secrets.GITHUB_TOKEN }}\n",
    "see http://localhost:8080/path@v2 and ssh://git@github.com/org/repo",
    "git clone https://user:${GIT_PASSWORD}@example.com/repo",
]

# Shapes a review found unscrubbed: each must come out with the secret gone and the label kept.
MISSED = {
    "PASSWORD=hunter2hunter2": "hunter2hunter2",  # bare keywords: no character before them
    "SECRET=abcdefgh99": "abcdefgh99",
    "TOKEN=abcdefgh99": "abcdefgh99",
    "export API_KEY=abcdefgh99": "abcdefgh99",
    "password: correct-horse-9": "correct-horse-9",  # lower case
    "  - Password: 'letmein99'": "letmein99",
    'api_key = "abcdef123456"  # prod': "abcdef123456",
    '{"apiKey": "AbCdEf123456xyz"}': "AbCdEf123456xyz",  # JSON
    "{'client_secret': 'zz-top-secret-1'}": "zz-top-secret-1",
    "git remote add origin https://bob:hunter2@github.com/x/y.git": "hunter2",  # URL credentials
    "//npm.pkg.github.com/:_authToken=ghx123456789": "ghx123456789",  # .npmrc
    "_auth=dXNlcjpwYXNzd29yZA==": "dXNlcjpwYXNzd29yZA==",
    "Authorization: Basic dXNlcjpwYXNzd29yZA==": "dXNlcjpwYXNzd29yZA==",
}


@pytest.mark.parametrize("text", sorted(MISSED))
def test_shapes_the_review_found_are_scrubbed(text):
    out = Redactor().scrub(text)
    assert MISSED[text] not in out and "[REDACTED:" in out
    assert out.split("[REDACTED:")[0] == text.split(MISSED[text])[0]  # the label before the secret stays


def test_placeholder_key_is_derived_from_the_session_secret_not_the_secret_itself():
    from gateway.redact import redaction_key

    key = redaction_key("s3cret")
    assert key != "s3cret" and key == redaction_key("s3cret") and key != redaction_key("other")
    assert Redactor(key=key).scrub(SAMPLES["bearer"]) != Redactor(key="s3cret").scrub(SAMPLES["bearer"])


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_each_kind_is_scrubbed_with_a_stable_placeholder(kind):
    r = Redactor(key="k")
    counts: Counter = Counter()
    out = r.scrub(SAMPLES[kind], counts)
    assert counts == {kind: 1}, out
    m = PLACEHOLDER.search(out)
    assert m and m.group(1) == kind
    assert r.scrub(SAMPLES[kind]) == out  # same secret, same placeholder
    assert r.scrub(out) == out  # idempotent: placeholders never match again
    assert Redactor(key="other").scrub(SAMPLES[kind]) != out  # the hash is keyed


def test_labels_around_a_secret_stay_readable():
    r = Redactor()
    assert r.scrub(SAMPLES["bearer"]).startswith("curl -H 'Authorization: Bearer [REDACTED:bearer:")
    assert r.scrub(SAMPLES["env_secret"]).startswith("DATABASE_PASSWORD=[REDACTED:env_secret:")
    assert BEARER not in r.scrub(SAMPLES["bearer"]) and AWS_SECRET not in r.scrub(SAMPLES["aws_secret_key"])


@pytest.mark.parametrize("text", BENIGN)
def test_ordinary_text_and_code_is_left_alone(text):
    counts: Counter = Counter()
    assert Redactor().scrub(text, counts) == text and not counts


def test_extra_patterns_disable_and_bad_regex():
    r = Redactor(RedactConfig(extra={"ticket": r"TCK-(?P<s>\d{6})"}, disable=["bearer"]))
    assert r.scrub("see TCK-123456").startswith("see TCK-[REDACTED:ticket:")
    assert r.scrub(SAMPLES["bearer"]) == SAMPLES["bearer"]
    with pytest.raises(ValueError, match="not a valid regex"):
        Redactor(RedactConfig(extra={"bad": "("}))
    with pytest.raises(ValueError, match="lower-case"):
        Redactor(RedactConfig(extra={"Bad Kind": "x"}))
    assert Redactor(RedactConfig(enabled=False)).scrub(SAMPLES["bearer"]) == SAMPLES["bearer"]


def test_scrub_request_counts_per_message_and_since_an_offset():
    req = ChatRequest(provider="openai.chat", model="m", messages=[
        Message("user", f"my key is {AWS_ID}"),
        Message("assistant", "", tool_calls=[ToolCall("c1", "shell", '{"command": "cat .env"}')]),
        Message("tool", f"DATABASE_PASSWORD=hunter2hunter2\nAuthorization: Bearer {BEARER}", tool_call_id="c1"),
    ], extras={"metadata": {"note": SAMPLES["github_token"]}})
    out, found = Redactor().scrub_request(req)
    assert req.messages[0].content.endswith(AWS_ID)  # the original is not modified
    text = repr(out)
    assert AWS_ID not in text and "hunter2hunter2" not in text and BEARER not in text and "ghp_" not in text
    assert found.counts == {"aws_access_key": 1, "env_secret": 1, "bearer": 1, "github_token": 1}
    assert found.since(2) == {"env_secret": 1, "bearer": 1, "github_token": 1}  # extras always count
    clean = ChatRequest(provider="openai.chat", model="m", messages=[Message("user", "hi")])
    assert Redactor().scrub_request(clean)[0] is clean


def test_placeholder_spans_cover_exactly_the_placeholder_tokens(chat_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    r = Redactor()
    text = r.scrub(f"The file says: aws_key {AWS_ID} and Bearer {BEARER}. Done.")
    ids = tok.encode(text, add_special_tokens=False)
    spans = placeholder_spans(ids, token_decoder(tok))
    assert len(spans) == 2
    for (a, b), m in zip(spans, PLACEHOLDER.finditer(text)):
        covered = tok.decode(ids[a:b])
        assert m.group(0) in covered
        assert m.group(0) not in tok.decode(ids[a + 1:b]) and m.group(0) not in tok.decode(ids[a:b - 1])  # minimal
    assert placeholder_spans(tok.encode("no secrets", add_special_tokens=False), token_decoder(tok)) == []


def test_session_event_detail_is_scrubbed_and_keeps_its_id():
    from gateway.redact import scrub_session_event
    from schemas import SessionEvent

    ev = SessionEvent(session_id="s", kind="finished", status="failed",
                      detail=f"harness exited with code 1: curl -H 'Authorization: Bearer {BEARER}'")
    out = scrub_session_event(ev, Redactor())
    assert BEARER not in out.detail and "[REDACTED:bearer:" in out.detail and out.event_id == ev.event_id
    clean = SessionEvent(session_id="s", kind="started", detail="node-1")
    assert scrub_session_event(clean, Redactor()) is clean


def _unfiltered(r: Redactor) -> Redactor:
    """The same patterns with every literal pre-check off: each regex runs on every text."""
    plain = Redactor(r.config, key=r.key.decode())
    plain._needles = [((), False)] * len(plain.patterns)
    return plain


ALL_KINDS = {**SAMPLES, "slack_token": "xoxb-123456789012-abcdefghij"}


@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_literal_prechecks_never_skip_a_secret(kind):
    from gateway.redact import PATTERNS

    assert set(ALL_KINDS) == set(PATTERNS)  # a new built-in kind needs a sample here (and needles in NEEDLES)
    r, secret = Redactor(), ALL_KINDS[kind]
    assert r.scrub(secret) != secret
    for text in (secret, f"see {secret} above", secret.lower(), secret.upper(), *(f"{b}\n{secret}" for b in BENIGN[:3])):
        assert r.scrub(text) == _unfiltered(r).scrub(text)


def test_a_session_memo_scrubs_only_new_messages_and_matches_a_fresh_scrub():
    from gateway.redact import ScrubMemo

    r, memo = Redactor(), ScrubMemo()
    first = [Message("user", f"deploy with {SAMPLES['openai_key']}"), Message("assistant", "ok")]
    req1 = ChatRequest(provider="openai.chat", model="m", messages=first)
    out1, found1 = r.scrub_request(req1, memo)
    later = [*first, Message("tool", f"export GITHUB_TOKEN={SAMPLES['github_token']}", tool_call_id="c1"),
             Message("user", "plain follow-up")]
    req2 = ChatRequest(provider="openai.chat", model="m", messages=later)
    out2, found2 = r.scrub_request(req2, memo)
    fresh, fresh_found = r.scrub_request(req2)
    assert out2.messages == fresh.messages and found2.counts == fresh_found.counts
    assert found2.per_message == fresh_found.per_message and found2.since(2) == fresh_found.since(2)
    assert out2.messages[0] is out1.messages[0]  # carried forward, not scanned again
    assert out2.messages[3] is later[3]  # nothing to scrub: the message itself, no copy
    edited = [Message("user", f"deploy with {SAMPLES['anthropic_key']}"), *later[1:]]
    out3, _ = r.scrub_request(ChatRequest(provider="openai.chat", model="m", messages=edited), memo)
    assert out3.messages == r.scrub_request(ChatRequest(provider="openai.chat", model="m", messages=edited))[0].messages
    assert SAMPLES["anthropic_key"] not in out3.messages[0].content
