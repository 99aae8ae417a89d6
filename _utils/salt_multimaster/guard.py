"""
The one wrapper of the public functions of the loader modules (runners,
execution modules, states): the arguments of a call are checked against
what the function accepts before it runs.

A misspelt keyword argument (``salt-run multimaster.sync peer=master02``)
is neither run with nor dropped: it is answered with the full list of the
arguments the function accepts, its named parameters included, and the
closest match (``difflib.get_close_matches``)::

    unknown argument peer: did you mean peers? (accepted: backup_keep, force, ...)

Salt checks (execution modules) or silently drops (runners) the keywords
of a function without ``**kwargs`` itself, with its own words: so the
wrapper shows Salt a signature that takes ``**kwargs``, checks them here,
and passes on only what the function takes.  Salt's own keywords
(``__pub_user``, ``__pub_jid``...) pass to a function with ``**kwargs``
and are dropped for the others.

No exception escapes to Salt (whose "The minion function caused an
exception" prints a traceback to the operator): whatever the function
raises is answered the same way, as a named error (the message of the
product's own errors, else the exception's class and message), and logged
with its traceback.  Each call notes the damaged state files it meets
(:func:`salt_multimaster.statefile.noticing`).

Each loader module answers a refused or failed call its own way (a runner's
``{"result": False, "error", "retcode"}``, a state's return, an execution
module's ``SaltInvocationError``/``CommandExecutionError``): it passes
``answer(fun, message, args, kwargs)`` (and ``fail``, for a failure, when
it differs) to :func:`public`.  Plain Python: testable without a daemon.
"""

import functools
import inspect
import logging
import types

from salt_multimaster import statefile, validate

log = logging.getLogger(__name__)


def refusal(sig, names, args, kwargs):
    """
    Why a function of signature ``sig``, accepting the keywords ``names``
    (its named parameters, and what its ``**kwargs`` takes), must not run
    with ``args`` and ``kwargs`` (Salt's own ``__`` keywords left out), or
    None: a keyword it does not accept (:func:`validate.known_kwargs`:
    every accepted one and the closest match), or arguments its signature
    cannot bind (too many positional arguments, one given twice, a required
    one missing).
    """
    try:
        validate.known_kwargs(kwargs, names)
    except validate.InvalidInput as exc:
        return str(exc)
    named = {k: v for k, v in kwargs.items() if k in sig.parameters}
    try:
        sig.bind(*args, **named)
    except TypeError as exc:
        return f"{exc} (accepted: {', '.join(names) or 'none'})"
    return None


def _named(fun, message):
    """``message`` of ``fun``, its name first (once)."""
    message = str(message)
    return message if message.startswith(f"{fun}:") else f"{fun}: {message}"


def failure(fun, exc):
    """
    The named error of ``exc`` raised by ``fun``: its message when it is
    one of the errors Salt and this product name (SaltException, ValueError:
    bad input, a damaged file), else its class and message; an unexpected
    one is logged with its traceback (the log, never the operator's screen).
    """
    from salt.exceptions import SaltException  # pylint: disable=import-outside-toplevel

    if isinstance(exc, (SaltException, ValueError)) and str(exc):
        log.error("multimaster: %s failed: %s", fun, exc)
        return _named(fun, exc)
    log.error("multimaster: %s failed", fun, exc_info=exc)
    return _named(fun, f"{exc.__class__.__name__}: {exc} (the log has the details)")


def public(module, answer, extra=(), fail=None):
    """
    The decorator of a loader module's public function ``module.<name>``:
    ``extra`` names what its ``**kwargs`` accepts; a refused call returns
    ``answer(fun, message, args, kwargs)`` (``fun``: ``module.<name>``,
    ``message`` naming it first), a failed one ``fail(fun, message, args,
    kwargs, exc)`` (default: ``answer``), ``message`` then :func:`failure`'s.
    """
    if fail is None:
        def fail(fun, message, args, kwargs, exc):  # pylint: disable=unused-argument
            return answer(fun, message, args, kwargs)

    def decorate(func):
        fun = f"{module}.{func.__name__}"
        sig = inspect.signature(func)
        params = sig.parameters.values()
        own = any(p.kind == p.VAR_KEYWORD for p in params)
        names = sorted({p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                             p.KEYWORD_ONLY)} | set(extra))
        check, named, noticing = refusal, _named, statefile.noticing
        failed, failing = failure, fail

        def guarded(*args, **kwargs):
            given = {k: v for k, v in kwargs.items() if not str(k).startswith("__")}
            message = check(sig, names, args, given)
            if message is not None:
                return answer(fun, named(fun, message), args, given)
            noticing()
            try:
                return func(*args, **(kwargs if own else given))
            except Exception as exc:  # pylint: disable=broad-except
                return failing(fun, failed(fun, exc), args, given, exc)

        # Salt sets a runner's __jid__ and __jid_event__ in the globals of
        # each of its functions: the wrapper's are the module's (its body
        # reads only its closure)
        guarded = types.FunctionType(guarded.__code__, func.__globals__, func.__name__, None,
                                     guarded.__closure__)
        functools.update_wrapper(guarded, func)
        # Salt reads the signature to decide which keywords to pass (and
        # would refuse or drop the unknown ones in its own words): show it
        # one that takes them all, keep the function's own for the docs
        del guarded.__wrapped__
        guarded.__signature__ = sig if own else sig.replace(parameters=[
            *params, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
        guarded.guarded = func
        return guarded

    return decorate
