"""A model folder's chat template, rendered as transformers renders it (jinja2's immutable sandbox,
trim_blocks, lstrip_blocks, loop controls: the same text, token for token) and within bounds.

The template is code from whoever wrote the folder. The sandbox keeps it to its inputs; the bounds
keep its cost: a render may take RENDER_SECONDS and make text of MAX_TEXT characters, and a template
that would take more (nested loops over huge ranges, 'x' * 10**10, a filter asked for a 10 GB
string) fails with a ChatTemplateError naming why, instead of hanging or exhausting memory. Every
attribute, item, call, operator and range charges the budget; on the main thread a timer also
stops a loop that calls nothing.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
import time
from collections.abc import Iterator

from jinja2 import runtime as jinja2_runtime
from jinja2.compiler import CodeGenerator
from jinja2.nodes import EvalContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

RENDER_SECONDS = 5.0
MAX_TEXT = 1 << 22  # characters (or items) any one value or the rendered text may have
MAX_RANGE_ITEMS = 1_000_000  # summed over every range() of one render
MAX_EXPONENT = 4096
RENDERING = "immutable-sandbox/trim_blocks/lstrip_blocks"  # part of a tokenizer's identity (cache keys)


class ChatTemplateError(ValueError):
    """The template does not parse, or failed or went past its bounds on a conversation."""


class _Budget(threading.local):
    deadline: float | None = None
    ranged: int = 0
    row_deadline: float | None = None  # every render of one conversation together (row_budget)


_budget = _Budget()


def _charge(items: int = 0) -> None:
    if _budget.deadline is None:
        return
    _budget.ranged += items
    if _budget.ranged > MAX_RANGE_ITEMS:
        raise ChatTemplateError(f"its loops ask for more than {MAX_RANGE_ITEMS:,} range() items")
    if time.monotonic() > _budget.deadline:
        raise ChatTemplateError(f"it took more than {RENDER_SECONDS:g} s")


def _too_big(value: object) -> bool:
    return isinstance(value, str | bytes | list | tuple | dict) and len(value) > MAX_TEXT


class _BoundedCode(CodeGenerator):
    """jinja2's code generator, with `~` (string concatenation) joined by the environment's bounded
    join: `{% set a = a ~ a %}` in a loop doubled a string past gigabytes before the timer could stop
    it (jinja2 compiles `~` to a plain join no sandbox sees, and folds constant ones at compile time)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_join((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    # Intercepted operators are also never folded at compile time, outside every bound below.
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCode

    @staticmethod
    def bounded_join(parts: tuple) -> str:
        """What `~` makes, refused past MAX_TEXT characters before it is made."""
        _charge()
        texts = [part if isinstance(part, str) else str(part) for part in parts]
        if sum(map(len, texts)) > MAX_TEXT:
            raise ChatTemplateError(f"it joins text of more than {MAX_TEXT:,} characters")
        return "".join(texts)

    @staticmethod
    def concat(pieces) -> str:
        """jinja2's join of a block's output (a macro's, `{% set %}...{% endset %}`, `{% filter %}`,
        the template's own), stopped once it passes MAX_TEXT characters rather than after."""
        kept, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > MAX_TEXT:
                raise ChatTemplateError(f"it renders more than {MAX_TEXT:,} characters")
            kept.append(piece)
        return "".join(kept)

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.globals["range"] = self._range
        self.globals["namespace"] = _BoundedNamespace
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}

    @staticmethod
    def _range(*args: int) -> range:
        span = range(*args)
        _charge(len(span))
        return span

    def call_binop(self, context, operator: str, left, right):
        _charge()
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise ChatTemplateError(f"it raises a number to the power {right}")
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, str | list | tuple) and isinstance(count, int) \
                        and len(sequence) * count > MAX_TEXT:
                    raise ChatTemplateError(f"it repeats a value {count:,} times (more than {MAX_TEXT:,} items)")
        if operator == "%" and isinstance(left, str):
            _check_percent_widths(left)
        result = super().call_binop(context, operator, left, right)
        if _too_big(result):
            raise ChatTemplateError(f"it makes a value of more than {MAX_TEXT:,} items")
        return result

    def getattr(self, obj, attribute):
        _charge()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _charge()
        return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):
        _charge()
        _check_sizes(args, kwargs)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format, keeping the method
        subject = getattr(method, "__self__", None)
        if isinstance(subject, str):
            args = _predicted(method.__name__, subject, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if _too_big(result):
            raise ChatTemplateError(f"it makes a value of more than {MAX_TEXT:,} items")
        return result


class _BoundedNamespace(Namespace):
    """`{% set ns.text = ns.text ~ ns.text %}` in a loop doubles a string past any memory: a
    namespace holds no value past MAX_TEXT."""

    def __setitem__(self, name, value):
        _charge()
        if _too_big(value):
            raise ChatTemplateError(f"it stores a value of more than {MAX_TEXT:,} items")
        super().__setitem__(name, value)


def _check_sizes(args: tuple, kwargs: dict) -> None:
    """A number past MAX_TEXT given to a call or filter ('x'.center(10**10), |indent(10**9)) would
    make text that large."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEXT:
            raise ChatTemplateError(f"it asks a call for {value:,} (more than {MAX_TEXT:,})")


def _predicted(name: str, subject: str, args: tuple, kwargs: dict) -> tuple:
    """A string method's result size, foreseen before it is made (the checks after a call came too
    late: `s.replace('x', s)`, `sep.join(many)`, `'{:>1073741824}'.format(...)` made a gigabyte first);
    ChatTemplateError past MAX_TEXT. The arguments to call it with (an iterable to join, listed)."""
    size = 0
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = subject.count(args[0]) if args[0] else len(subject) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        size = len(subject) + count * (len(args[1]) - len(args[0]))
    elif name == "join" and args:
        items = list(args[0])
        size = sum(len(item) if isinstance(item, str) else 0 for item in items) + len(subject) * len(items)
        args = (items, *args[1:])
    elif name in ("format", "format_map"):
        widths = [int(width) for width in re.findall(r"\{[^{}]*:[^{}]*?(\d{7,})", subject)]
        size = max(widths, default=0)
    elif name == "expandtabs":
        size = len(subject) + subject.count("\t") * (args[0] if args and isinstance(args[0], int) else 8)
    if size > MAX_TEXT:
        raise ChatTemplateError(f"it makes text of more than {MAX_TEXT:,} characters ({name})")
    return args


def _predicted_filter(name: str, args: tuple) -> tuple:
    """The same for the filters that build text from their input: join, replace, indent, format."""
    if not args:
        return args
    value, rest = args[0], args[1:]
    if name == "join" and not isinstance(value, str):
        items = list(value)
        separator = rest[0] if rest and isinstance(rest[0], str) else ""
        if sum(len(str(item)) for item in items) + len(separator) * len(items) > MAX_TEXT:
            raise ChatTemplateError(f"it joins text of more than {MAX_TEXT:,} characters")
        return (items, *rest)
    if isinstance(value, str) and name == "replace":
        _predicted("replace", value, rest, {})
    if isinstance(value, str) and name == "indent":
        width = rest[0] if rest and isinstance(rest[0], int) else 4
        if len(value) + (value.count("\n") + 1) * (width if isinstance(width, int) else len(str(width))) > MAX_TEXT:
            raise ChatTemplateError(f"it indents into more than {MAX_TEXT:,} characters")
    if isinstance(value, str) and name == "format":  # the filter is `value % args`
        _check_percent_widths(value)
    return args


def _check_percent_widths(text: str) -> None:
    """A %-format whose width or precision passes MAX_TEXT ('%0900000000d', '%.999999999f') would
    make text that wide: refused before it is made (the `%` operator and the format filter alike)."""
    widths = re.findall(r"%[-+ #0]*(\d{7,})", text) + re.findall(r"%[-+ #0]*\d*\.(\d{7,})", text)
    if any(int(width) > MAX_TEXT for width in widths):
        raise ChatTemplateError(f"it formats a value wider than {MAX_TEXT:,} characters")


def _bounded_filter(function):
    name = function.__name__.removeprefix("do_")

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        _charge()
        _check_sizes(args, kwargs)
        # A filter that takes the environment, context or eval context first (jinja2's pass_* filters):
        # its value next.
        offset = 1 if args and isinstance(args[0], ImmutableSandboxedEnvironment | jinja2_runtime.Context
                                           | EvalContext) else 0
        args = (*args[:offset], *_predicted_filter(name, args[offset:]))
        result = function(*args, **kwargs)
        if _too_big(result):
            raise ChatTemplateError(f"a filter made a value of more than {MAX_TEXT:,} items")
        return result
    return bounded


ENVIRONMENT = BoundedEnvironment()


class ChatTemplate:
    """A template's text, compiled on first use (a template that does not parse fails as the first
    conversation is rendered, where the data gate can say so beside a row)."""

    def __init__(self, text: str):
        self.text = text
        self._compiled = None

    def render(self, messages: list[dict]) -> str:
        with _bounded():
            if self._compiled is None:
                try:  # within the bounds too: compiling folds constant expressions
                    self._compiled = ENVIRONMENT.from_string(self.text)
                except ChatTemplateError:
                    raise
                except Exception as exc:  # noqa: BLE001 - whatever the model's template does is its failure
                    raise ChatTemplateError(f"it does not parse: {_why(exc)}") from None
            try:
                chunks, size = [], 0
                for chunk in self._compiled.generate(messages=messages, add_generation_prompt=False):
                    size += len(chunk)
                    if size > MAX_TEXT:
                        raise ChatTemplateError(f"it renders more than {MAX_TEXT:,} characters")
                    chunks.append(chunk)
                return "".join(chunks)
            except ChatTemplateError:
                raise
            except Exception as exc:  # noqa: BLE001 - LookupError, SecurityError, ...: the template's failure
                raise ChatTemplateError(f"it failed: {_why(exc)}") from None


@contextlib.contextmanager
def row_budget() -> Iterator[None]:
    """One budget of RENDER_SECONDS for every render of one conversation (training renders each
    prefix of it: a conversation of thousands of turns was thousands of budgets)."""
    _budget.row_deadline = time.monotonic() + RENDER_SECONDS
    try:
        yield
    finally:
        _budget.row_deadline = None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def _bounded() -> Iterator[None]:
    """The budget for one render, and on the main thread (where no other timer runs) a timer that
    stops a loop the hooks never see."""
    now = time.monotonic()
    _budget.deadline, _budget.ranged = min(now + RENDER_SECONDS, _budget.row_deadline or float("inf")), 0
    if _budget.deadline <= now:
        raise ChatTemplateError(f"its renders of one conversation took more than {RENDER_SECONDS:g} s")
    timer = threading.current_thread() is threading.main_thread() and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    previous = signal.getsignal(signal.SIGALRM) if timer else None
    if timer:
        def expired(_signum, _frame):
            raise ChatTemplateError(f"it took more than {RENDER_SECONDS:g} s")
        signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, _budget.deadline - now + 0.5)
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        _budget.deadline = None
