"""ResourceStore: a tenant's JSON collections, one file per collection under /data/<tenant>/.

Every write goes to a temporary file that is flushed, fsynced and renamed over the old one,
so a collection file is always either the old or the new version. kiln runs one session per
tenant and one request at a time in it, so a read-modify-write never races another.
"""

import json
import os
import re
import stat

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


class PolicyError(BaseException):
    """A rule of the sandbox was broken. Derives from BaseException so that `except
    Exception` in generated code cannot swallow it."""


class HttpError(Exception):
    """An error that becomes an HTTP answer: status, code and message."""

    status = 500
    code = "ERROR"

    def __init__(self, message, details=None):
        super().__init__(message)
        self.message = str(message)
        self.details = details


class BadRequest(HttpError):
    status = 400
    code = "BAD_REQUEST"


class NotFound(HttpError):
    status = 404
    code = "NOT_FOUND"


class Conflict(HttpError):
    status = 409
    code = "CONFLICT"


class UnsupportedMediaType(HttpError):
    status = 415
    code = "UNSUPPORTED_MEDIA_TYPE"


def same_id(a, b):
    """Ids match by value or by their text (`/members/1` finds id 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b or str(a) == str(b)


def _sort_key(field):
    def key(item):
        value = item.get(field) if isinstance(item, dict) else None
        if value is None:
            return (3, "")
        if isinstance(value, bool):
            return (0, int(value))
        if isinstance(value, (int, float)):
            return (0, value)
        if isinstance(value, str):
            return (1, value.casefold())
        return (2, json.dumps(value, sort_keys=True))

    return key


def merge_patch(target, patch):
    """RFC 7396 JSON merge patch: objects merge, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _matches(item, field, wanted):
    """`field` equal to `wanted` (text compared without case), or `field__contains`."""
    contains = field.endswith("__contains")
    if contains:
        field = field[: -len("__contains")]
    if not isinstance(item, dict) or field not in item:
        return False
    value = item[field]
    options = wanted if isinstance(wanted, list) else [wanted]
    for option in options:
        if contains:
            if isinstance(value, list):
                if any(same_id(v, option) or (isinstance(v, str) and str(option).casefold() in v.casefold()) for v in value):
                    return True
            elif str(option).casefold() in _text(value).casefold():
                return True
        elif isinstance(value, str) and isinstance(option, str):
            if value.casefold() == option.casefold():
                return True
        elif same_id(value, option):
            return True
        elif isinstance(value, bool) and str(option).lower() == str(value).lower():
            return True
    return False


def _text(value):
    return value if isinstance(value, str) else json.dumps(value)


class Collection:
    """One collection: a JSON list of objects, each with an `id`."""

    def __init__(self, root, name):
        self._root = root
        self._name = name
        self._path = root + "/" + name + ".json"
        self._seen = None
        self._items = None

    @property
    def name(self):
        return self._name

    def _load(self):
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            self._seen, self._items = None, []
            return self._items
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen != self._seen or self._items is None:
            with open(self._path, "rb") as f:
                items = json.loads(f.read() or b"[]")
            if not isinstance(items, list):
                raise PolicyError(f"the collection file {self._name}.json is not a JSON list")
            self._seen, self._items = seen, items
        return self._items

    def _save(self, items):
        data = json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode()
        tmp = self._root + "/." + self._name + ".json.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)
        try:
            fd = os.open(self._root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        st = os.stat(self._path)
        self._seen, self._items = (st.st_mtime_ns, st.st_size, st.st_ino), items

    def _index(self, items, id):
        for i, item in enumerate(items):
            if isinstance(item, dict) and same_id(item.get("id"), id):
                return i
        return -1

    def get_all(self):
        return [dict(item) for item in self._load()]

    def count(self):
        return len(self._load())

    def get(self, id):
        items = self._load()
        i = self._index(items, id)
        return dict(items[i]) if i >= 0 else None

    def insert(self, obj):
        """Adds `obj`; returns its id, also set as `obj["id"]`: the client's id if it gave
        one (kept as given), else one more than the largest integer id."""
        if not isinstance(obj, dict):
            raise BadRequest("a resource must be a JSON object")
        items = list(self._load())
        given, obj = obj, dict(obj)
        if "id" in obj and obj["id"] is not None:
            new_id = obj["id"]
            if isinstance(new_id, bool) or not isinstance(new_id, (int, str)) or new_id == "":
                raise BadRequest("an id must be a non-empty string or an integer")
            if self._index(items, new_id) >= 0:
                raise Conflict(f"{self._name}/{new_id} already exists")
        else:
            ints = [i.get("id") for i in items if isinstance(i, dict)]
            ints = [i for i in ints if isinstance(i, int) and not isinstance(i, bool)]
            new_id = max(ints, default=0) + 1
        obj["id"] = new_id
        items.append(obj)
        self._save(items)
        given["id"] = new_id
        return new_id

    def replace(self, id, obj):
        """Replaces the whole object (keeping its id); None when there is none."""
        if not isinstance(obj, dict):
            raise BadRequest("a resource must be a JSON object")
        items = list(self._load())
        i = self._index(items, id)
        if i < 0:
            return None
        obj = dict(obj)
        obj["id"] = items[i]["id"]
        items[i] = obj
        self._save(items)
        return dict(obj)

    def patch(self, id, changes):
        """Merges `changes` into the object (RFC 7396; the id stays); None when there is none."""
        if not isinstance(changes, dict):
            raise BadRequest("a patch must be a JSON object")
        items = list(self._load())
        i = self._index(items, id)
        if i < 0:
            return None
        obj = merge_patch(items[i], changes)
        obj["id"] = items[i]["id"]
        items[i] = obj
        self._save(items)
        return dict(obj)

    def delete(self, id):
        items = list(self._load())
        i = self._index(items, id)
        if i < 0:
            return False
        del items[i]
        self._save(items)
        return True

    def search(self, filters):
        """Objects matching every filter: `field=value` (text without case) or
        `field__contains=part`; a list of values matches any of them."""
        if not isinstance(filters, dict):
            raise BadRequest("search filters must be an object")
        return [
            dict(item)
            for item in self._load()
            if all(_matches(item, f, v) for f, v in filters.items())
        ]


class ResourceStore:
    """The tenant's collections. Names: a letter, then letters, digits, `_` or `-` (64 at most)."""

    def __init__(self, root):
        self._root = root
        self._open = {}

    def collection(self, name):
        if not isinstance(name, str) or not NAME.match(name):
            raise BadRequest(f"{name!r} is not a collection name (a letter, then letters, digits, _ or -)")
        found = self._open.get(name)
        if found is None:
            found = self._open[name] = Collection(self._root, name)
        return found

    def collections(self):
        try:
            names = os.listdir(self._root)
        except FileNotFoundError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and NAME.match(n[:-5]))

    @staticmethod
    def sort(items, spec):
        """Sorts by `field`, or `-field` for descending; missing values last."""
        if not isinstance(spec, str) or not spec.strip("-"):
            raise BadRequest("sort must name a field, or -field for descending")
        reverse = spec.startswith("-")
        return sorted(items, key=_sort_key(spec.lstrip("-")), reverse=reverse)

    @staticmethod
    def page(items, limit, offset):
        return {
            "items": items[offset : offset + limit],
            "page": {"limit": limit, "offset": offset, "total": len(items)},
        }


class NoResource(Exception):
    """The plan's code used the store's own methods, but the plan names no collection."""


class BoundStore:
    """`store` as a plan's code sees it: the collection its plan names (`resource`), with
    the collection's methods, and `collection(name)` for any other."""

    def __init__(self, store, resource):
        self._store = store
        self._resource = resource if isinstance(resource, str) and NAME.match(resource) else None
        self._inserted = None

    def _bound(self):
        if self._resource is None:
            raise NoResource("the plan names no collection (resource): use store.collection(name)")
        return self._store.collection(self._resource)

    @property
    def name(self):
        return self._resource

    def get_all(self):
        return self._bound().get_all()

    def count(self):
        return self._bound().count()

    def get(self, id):
        return self._bound().get(id)

    def insert(self, obj):
        self._inserted = self._bound().insert(obj)
        return self._inserted

    def replace(self, id, obj):
        return self._bound().replace(id, obj)

    def patch(self, id, delta):
        return self._bound().patch(id, delta)

    def delete(self, id):
        return self._bound().delete(id)

    def search(self, filters):
        return self._bound().search(filters)

    def collection(self, name):
        return self._store.collection(name)

    def collections(self):
        return self._store.collections()

    sort = staticmethod(ResourceStore.sort)
    page = staticmethod(ResourceStore.page)


_OPEN_MODE = re.compile(r"^[rwax](?:[bt]?\+?|\+[bt])$")


def tenant_opener(root):
    """safe_open(path, mode="r", encoding=None): open() confined to the tenant's folder.
    Relative paths only; no `..`, no names starting with `.` (kiln's own), nothing that
    resolves outside the folder (a link included). Writing creates missing folders, each
    one under the tenant's folder: in the sandbox the tenant's folder is the only one the
    guest may look at, so nothing above it is ever looked at (os.makedirs would stat its
    way up to `/` and fail there)."""
    real_root = os.path.realpath(root)

    def safe_open(path, mode="r", encoding=None):
        try:
            path = os.fspath(path)  # text, or a pathlib path
        except TypeError:
            path = None
        if not isinstance(path, str) or not path or "\0" in path:
            raise PolicyError("safe_open needs a relative path (text) in the tenant's folder")
        if not isinstance(mode, str) or not _OPEN_MODE.match(mode):
            raise PolicyError(f"safe_open refuses the mode {mode!r} (r, w, a or x, with b, t or +)")
        if path.startswith("/"):
            raise PolicyError(f"safe_open refuses the absolute path {path!r}: paths are relative to the tenant's folder")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if not parts or any(p.startswith(".") for p in parts):
            raise PolicyError(f"safe_open refuses {path!r}: no '..', and no names starting with '.'")
        # Links are followed (in the guest, lstat above the tenant's folder fails, which
        # realpath takes as "no link there"); where they lead must stay inside.
        full = os.path.realpath(os.path.join(real_root, *parts))
        if not full.startswith(real_root + "/"):
            raise PolicyError(f"safe_open refuses {path!r}: it leads outside the tenant's folder")
        names = full[len(real_root) + 1:].split("/")
        link = _unresolved_link(real_root, names)
        if link is not None:
            raise PolicyError(
                f"safe_open refuses {path!r}: it leads outside the tenant's folder (the link {link!r} cannot be followed inside it)"
            )
        if mode[0] != "r":
            _make_folders(real_root, names[:-1])
        if "b" in mode:
            return open(full, mode)
        return open(full, mode, encoding=encoding or "utf-8")

    return safe_open


def _unresolved_link(root, names):
    """The first of root/names... that is a link, or that cannot be looked at (None when
    none is). realpath resolves every link it can read, so one left in its answer is one it
    could not: in the guest, a link to an absolute path (readlink is refused) or one that
    loops."""
    at = root
    for name in names:
        at = at + "/" + name
        try:
            mode = os.lstat(at).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None  # the rest does not exist yet; open() or the folders make it
        except OSError:
            return at[len(root) + 1:]
        if stat.S_ISLNK(mode):
            return at[len(root) + 1:]
    return None


def _make_folders(root, names):
    """Makes root/names[0]/names[1]/... where missing, one folder at a time from `root`
    down (never looking above it)."""
    at = root
    for name in names:
        at = at + "/" + name
        try:
            os.mkdir(at)
        except FileExistsError:
            pass
