"""Arguments pybind11 could not convert, explained in one line (docs/python.md, "Errors").

When no signature of an epx._epx function accepts the arguments, pybind11 raises a
TypeError listing every signature. explain_all() wraps each function, method, constructor
and property setter of the extension once, so that this case raises instead:

- TypeError "Buffer(): transport = None is not an epx.Transport" (None or another type);
- epx.InvalidArgumentError "Buffer(): num_experts = 1099511627776 is outside
  [-2147483648, 2147483647] (int)" for an integer outside the C++ type ("int" is 32 bits,
  "int64" 64 bits, as the signatures say).

Methods whose arguments are all objects (Buffer.dispatch, combine, ...: the binding checks
them itself, with epx's messages) are left unwrapped: no argument of theirs can be blamed.

Arguments are matched to the signature pybind11 prints first in the docstring; when no
argument can be blamed, pybind11's own TypeError is raised unchanged.
"""
import functools
import numbers
import re

from .errors import InvalidArgumentError

_RANGES = {"int": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
_SIGNATURE = re.compile(r"^\s*(?:\d+\.\s*)?([A-Za-z_][\w.]*)?\((.*)\)(?:\s*->.*)?$")


def _split_top_level(text):
    """Splits `text` at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def parse_signature(doc):
    """[(name, type, has_default, keyword_only)] of the first signature in a pybind11 docstring."""
    for line in (doc or "").splitlines():
        match = _SIGNATURE.match(line)
        if match:
            break
    else:
        return None
    params, keyword_only = [], False
    for part in _split_top_level(match.group(2)):
        if part == "*":
            keyword_only = True
            continue
        if part.startswith("*"):
            return None  # *args / **kwargs: nothing to check
        head, eq, _ = part.partition("=")
        name, _, annotation = head.partition(":")
        params.append((name.strip(), annotation.strip(), bool(eq), keyword_only))
    return params


def _type_label(annotation):
    return annotation.replace("epx._epx.", "epx.")


def _check_int(value, annotation):
    """None if value converts to the integer type `annotation`, else (exception class, why)."""
    integral = isinstance(value, numbers.Integral) or hasattr(value, "__index__")
    if isinstance(value, float) or not integral:
        return TypeError, f"is not an integer ({type(value).__name__})"
    low, high = _RANGES[annotation]
    if not low <= int(value) <= high:
        return InvalidArgumentError, f"is outside [{low}, {high}] ({annotation})"
    return None


def _check_list(value, inner):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not hasattr(value, "__getitem__"):
        return TypeError, f"is not a list ({type(value).__name__})"
    for i, item in enumerate(value):
        why = check_value(item, inner)
        if why:
            return why[0], f"[{i}] = {item!r} {why[1]}"
    return None


def check_value(value, annotation, module=None):
    """None if `value` converts to the pybind11 type `annotation`, else (exception class, why)."""
    optional = re.fullmatch(r"Optional\[(.*)\]", annotation)
    if optional:
        return None if value is None else check_value(value, optional.group(1), module)
    listed = re.fullmatch(r"List\[(.*)\]", annotation)
    if listed:
        return _check_list(value, listed.group(1))
    if annotation in _RANGES:
        return _check_int(value, annotation)
    if annotation == "float":
        ok = isinstance(value, numbers.Real) or hasattr(value, "__float__")
        return None if ok else (TypeError, f"is not a number ({type(value).__name__})")
    if annotation == "bool":
        # pybind11 takes None as False, and numbers through their truth value
        ok = value is None or isinstance(value, numbers.Number) or type(value).__name__ == "bool_"
        return None if ok else (TypeError, f"is not a bool ({type(value).__name__})")
    if annotation == "str":
        ok = isinstance(value, (str, bytes))
        return None if ok else (TypeError, f"is not a str ({type(value).__name__})")
    if annotation == "dtype":
        ok = isinstance(value, str) or type(value).__name__.startswith("dtype")
        return None if ok else (TypeError, f"is not a dtype name or a torch / numpy dtype ({type(value).__name__})")
    if annotation == "function":
        return None if callable(value) else (TypeError, f"is not callable ({type(value).__name__})")
    if annotation.startswith("epx._epx.") and module is not None:
        cls = getattr(module, annotation[len("epx._epx."):], None)
        if isinstance(cls, type) and not isinstance(value, cls):
            return TypeError, f"is not an {_type_label(annotation)} ({type(value).__name__})"
    return None


def _bind(params, args, kwargs):
    """{name: value} of the arguments given, matched as Python matches them; None if they do not match."""
    if len(args) > sum(1 for p in params if not p[3]):
        return None
    bound = {}
    for (name, *_), value in zip(params, args):
        bound[name] = value
    for name, value in kwargs.items():
        if name in bound or name not in {p[0] for p in params}:
            return None
        bound[name] = value
    return bound


def _message(where, name, value, why):
    """"where: name = value why"; a property setter's `where` ("RouterConfig.topk") is the name."""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{where} = {shown} {why}" if name is None else f"{where}: {name} = {shown} {why}"


def explain(where, doc, args, kwargs, module=None, setter=False):
    """The exception naming the first argument of `args`/`kwargs` that the signature in `doc`
    does not accept; None when none can be blamed. setter: `where` names the one argument."""
    params = parse_signature(doc)
    if params is None:
        return None
    bound = _bind(params, args, kwargs)
    if bound is None:
        return None
    for name, annotation, _, _ in params:
        if name in bound and name != "self":
            why = check_value(bound[name], annotation, module)
            if why:
                return why[0](_message(where, None if setter else name, bound[name], why[1]))
    return None


def _wrap(fn, where, doc, module, setter=False):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError as error:
            if "incompatible function arguments" not in str(error) and "incompatible constructor" not in str(error):
                raise
            better = explain(where, doc, args, kwargs, module, setter)
            if better is None:
                raise
        raise better from None
    call.__epx_explained__ = True
    return call


def _takes_any_objects(doc):
    """True when the one signature in `doc` takes only objects (pybind11's `handle`) besides self:
    pybind11 then refuses a call only for the number or names of its arguments, which explain()
    never blames, so a wrapper would add a Python call to every call (the exchange's hot path:
    dispatch, combine) and explain nothing."""
    params = parse_signature(doc)
    return (params is not None and "Overloaded function" not in doc
            and all(annotation in ("handle", "object") for name, annotation, _, _ in params if name != "self"))


def _is_pybind_function(obj):
    return type(obj).__name__ in ("builtin_function_or_method", "instancemethod")


def _explain_class(cls, module):
    for name, member in list(vars(cls).items()):
        if isinstance(member, property):
            if member.fset is not None and _is_pybind_function(member.fset):
                fset = getattr(member.fset, "__func__", member.fset)
                setter = _wrap(fset, f"{cls.__name__}.{name}", fset.__doc__, module, setter=True)
                setattr(cls, name, property(member.fget, setter, member.fdel, member.__doc__))
            continue
        if isinstance(member, staticmethod):
            inner = member.__func__
            if _is_pybind_function(inner):
                where = f"{cls.__name__}.{name}()"
                setattr(cls, name, staticmethod(_wrap(inner, where, inner.__doc__, module)))
            continue
        if type(member).__name__ != "instancemethod" or name.startswith("__") and name != "__init__":
            continue
        function = member.__func__
        if _takes_any_objects(function.__doc__):
            continue
        where = f"{cls.__name__}()" if name == "__init__" else f"{cls.__name__}.{name}()"
        setattr(cls, name, _wrap(function, where, function.__doc__, module))


def explain_all(module):
    """Wraps every function, method, constructor and property setter of `module` (once)."""
    if getattr(module, "__epx_explained__", False):
        return
    for name, obj in list(vars(module).items()):
        if name.startswith("_"):
            continue
        if isinstance(obj, type):
            _explain_class(obj, module)
        elif _is_pybind_function(obj):
            setattr(module, name, _wrap(obj, f"{name}()", obj.__doc__, module))
    module.__epx_explained__ = True
