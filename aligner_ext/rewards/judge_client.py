"""A client for OpenAI-compatible chat-completions judges, on the maintained `openai` client.

One request is `POST <base_url>/chat/completions` with `{"model", "messages", "temperature",
"max_tokens"}`; the reply text is `choices[0].message.content`, which the caller's `parse` turns
into a value (a rubric verdict). `JudgeClient.complete(messages, parse)` adds:

- a concurrency limit: at most `max_concurrency` requests of one client in flight (a semaphore);
  `JudgeClient.map` fans calls out over a thread pool of the same size;
- a time limit of `timeout_s` per HTTP request (connect and each read);
- retries: a refused or timed-out connection, HTTP 408/409/429/5xx, a malformed body, and a reply
  that `parse` rejects (ValueError) are tried again, up to `max_retries` more times, waiting
  `backoff_s`, then twice as long each time. Other HTTP errors (400, 401, 403, 404, ...) are
  configuration errors and fail at once;
- a cache of identical requests (same URL, model, messages, temperature, max_tokens): a parsed
  value is kept (up to `cache_size`, least recently used dropped first) and returned without a
  request. Failures are never cached;
- the API key is read from the environment variable named by `api_key_env` when the client is
  built and sent as a Bearer token; it is never logged and never put in an error message or repr,
  and text quoted from the server (error bodies, malformed replies) has the key and any Bearer
  token replaced by `***` first, for servers that echo the request's headers.
  An unset variable sends no Authorization header (local servers such as vLLM need none);
- clear errors: `JudgeUnavailable` when the endpoint could not be reached (down, refusing,
  timing out) after every attempt, naming the URL and what to check; `JudgeError` for every other
  failure (an HTTP error status, replies that never parse).

Decisions:
- The `openai` client sends the requests (its own retries off: this client's retry loop also
  retries replies that `parse` rejects, with the backoff above); its errors are mapped to the rules
  above (APIStatusError -> the status, APIConnectionError / APITimeoutError -> unreachable).
- The cache and the limit are per client, and a client lives in one process: reward workers each
  build their own (aligner_ext/rewards/rubric.py says why the judge runs there).
- `JudgeConfig` is a plain (mutable) dataclass so it can be the run config's `reward.judge`
  section; clients are cached per field values (`JudgeConfig.key`), not per object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

import openai

from aligner_ext.rewards.settings import JudgeConfig

logger = logging.getLogger(__name__)
_BEARER = re.compile(r"(?i)bearer\s+[^\s\"',;]+")

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})  # HTTP statuses worth another attempt

T = TypeVar("T")
U = TypeVar("U")


class JudgeError(RuntimeError):
    """The judge gave no usable answer (an HTTP error status, replies that never parse)."""


class JudgeUnavailable(JudgeError):
    """The judge endpoint could not be reached (down, refusing connections, or timing out)."""


@dataclass
class JudgeOutcome:
    """The parsed reply of one `complete` call and how it was obtained."""

    value: Any  # what `parse` returned
    attempts: int  # HTTP requests made (0 when cached)
    latency_s: float  # wall time of the call, retries and waits included
    cached: bool  # answered from the cache, no request made


class _Retry(Exception):
    """One failed attempt that is worth repeating; `unreachable` when no HTTP reply came back."""

    def __init__(self, reason: str, unreachable: bool):
        super().__init__(reason)
        self.unreachable = unreachable


class JudgeClient:
    """Sends chat-completions requests with a concurrency limit, retries and a cache (module docstring)."""

    def __init__(self, cfg: JudgeConfig, environ: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        environ = os.environ if environ is None else environ
        self._api_key = environ.get(cfg.api_key_env) if cfg.api_key_env else None
        # without a key the Authorization header is left out (local servers such as vLLM need none)
        self._client = openai.OpenAI(base_url=cfg.base_url, api_key=self._api_key or "unset", max_retries=0,
                                     timeout=cfg.timeout_s)
        self._headers = {} if self._api_key else {"Authorization": openai.Omit()}
        self._slots = threading.BoundedSemaphore(cfg.max_concurrency)
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="judge")
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_lock = threading.Lock()

    def __repr__(self) -> str:  # never shows the key
        return f"JudgeClient(url={self.url!r}, model={self.cfg.model!r}, api_key={'set' if self._api_key else 'unset'})"

    def complete(self, messages: list[dict[str, str]], parse: Callable[[str], T]) -> JudgeOutcome:
        """The parsed reply to `messages`; raises JudgeUnavailable or JudgeError after the last attempt."""
        key = self._cache_key(messages)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return JudgeOutcome(self._cache[key], attempts=0, latency_s=0.0, cached=True)
        started = time.monotonic()
        failures: list[_Retry] = []
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                value = self._parse(self._post(messages), parse)
            except _Retry as failure:
                failures.append(failure)
                logger.debug("judge attempt %d/%d failed: %s", attempt + 1, self.cfg.max_retries + 1, failure)
                continue
            self._remember(key, value)
            return JudgeOutcome(value, attempts=attempt + 1, latency_s=time.monotonic() - started, cached=False)
        raise self._final_error(failures)

    def map(self, fn: Callable[[U], T], items: Iterable[U]) -> list[T]:
        """`[fn(item) for item in items]`, run on the client's thread pool; the first exception propagates."""
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _post(self, messages: list[dict[str, str]]) -> str:
        """The reply text of one request; raises _Retry for a retryable failure, JudgeError otherwise."""
        with self._slots:
            try:
                reply = self._client.chat.completions.create(
                    model=self.cfg.model, messages=messages, temperature=self.cfg.temperature,
                    max_tokens=self.cfg.max_tokens, extra_headers=self._headers)
            except openai.APIStatusError as err:
                detail = self._redact(err.response.text[:300].strip())
                if err.status_code in RETRY_STATUS:
                    raise _Retry(f"HTTP {err.status_code}: {detail}", unreachable=False) from None
                hint = f"; check the API key in ${self.cfg.api_key_env}" if err.status_code in (401, 403) else ""
                raise JudgeError(f"judge endpoint {self.url} answered HTTP {err.status_code}: {detail}{hint}") from None
            except openai.APITimeoutError:
                raise _Retry("TimeoutError: timed out", unreachable=True) from None
            except openai.APIConnectionError as err:
                cause = err.__cause__ or err
                raise _Retry(f"{type(cause).__name__}: {cause}", unreachable=True) from None
            except (openai.APIResponseValidationError, ValueError) as err:
                raise _Retry(f"malformed chat-completions body: {self._redact(str(err)[:200])!r}", unreachable=False) from None
        try:
            content = reply.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            quoted = self._redact(str(reply)[:200])
            raise _Retry(f"malformed chat-completions body: {quoted!r}", unreachable=False)
        return content

    def _redact(self, text: str) -> str:
        """`text` from the server with the API key and any Bearer token replaced by ***."""
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return _BEARER.sub("Bearer ***", text)

    def _parse(self, text: str, parse: Callable[[str], T]) -> T:
        try:
            return parse(text)
        except ValueError as err:
            raise _Retry(f"unusable reply ({self._redact(str(err))}): {self._redact(text[:200])!r}",
                         unreachable=False) from None

    def _final_error(self, failures: list[_Retry]) -> JudgeError:
        attempts = len(failures)
        if all(f.unreachable for f in failures):
            return JudgeUnavailable(
                f"judge endpoint {self.url} unreachable after {attempts} attempts ({failures[-1]}); is the server "
                f"running and is the judge's base_url (reward.judge.base_url) right? (timeout {self.cfg.timeout_s:g} s per request)")
        return JudgeError(f"judge at {self.url} gave no usable reply after {attempts} attempts; last: {failures[-1]}")

    def _cache_key(self, messages: list[dict[str, str]]) -> str:
        request = [self.url, self.cfg.model, self.cfg.temperature, self.cfg.max_tokens, messages]
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode("utf-8")).hexdigest()

    def _remember(self, key: str, value: Any) -> None:
        if self.cfg.cache_size == 0:
            return
        with self._cache_lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
