"""Cloud Storage's JSON API on 127.0.0.1, as much of it as gcsfs, google-cloud-storage and
tensorstore (orbax's arrays) use: bucket and object metadata, listing (prefix, delimiter, offsets,
pages), downloads (whole or a byte range, with the generation headers), media, multipart and
resumable uploads, compose, copy (rewriteTo) and move (moveTo), delete, with generations and the
ifGenerationMatch / ifGenerationNotMatch preconditions (HTTP 412, 304), which the server checks
atomically as Cloud Storage does (https://cloud.google.com/storage/docs/request-preconditions).

A client process reaches it under ``gcs.client_env()`` (no credentials, nothing leaves the
machine). ``hold(name, clients)`` answers the requests on object ``name`` only once each client
has sent one, so that racing clients really race: none is answered before all have asked.

Used by tests/test_workdir_safety.py (the lock of a gs:// workdir, two processes contending; a
run's orbax checkpoints in a bucket, resumed from; a checkpoint's replacement cut short there).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import sys
import threading
import urllib.parse


class GCSEmulator:
  """``with GCSEmulator() as gcs:`` serves at ``gcs.url``; ``gcs.objects[(bucket, name)]`` is
  ``(data, generation)``."""

  def __init__(self):
    self.objects: dict[tuple[str, str], tuple[bytes, int]] = {}
    self._lock = threading.Lock()
    self._generation = 1000
    self._held: dict[str, tuple] = {}  # name -> (clients to come, all came, timeout)
    self._sessions: dict[str, tuple] = {}  # resumable uploads: id -> (name, query, data)
    self._server = _Server(('127.0.0.1', 0), _handler(self))
    self.url = f'http://127.0.0.1:{self._server.server_address[1]}'

  def __enter__(self) -> GCSEmulator:
    threading.Thread(target=self._server.serve_forever, daemon=True).start()
    return self

  def __exit__(self, *exc_info):
    self._server.shutdown()
    self._server.server_close()

  def client_env(self) -> dict[str, str]:
    """Environment variables under which a process's gs:// traffic comes here, anonymously:
    gcsfs and google-cloud-storage (``STORAGE_EMULATOR_HOST``), etils.epath through gcsfs
    (``EPATH_USE_TF=false``; no gRPC bucket-layout lookup) and tensorstore's own client
    (``TENSORSTORE_GCS_HTTP_URL``, with a fixed token instead of Google credentials)."""
    return {'STORAGE_EMULATOR_HOST': self.url, 'FSSPEC_GS_TOKEN': 'anon',
            'FSSPEC_GCS_TOKEN': 'anon', 'EPATH_USE_TF': 'false',
            'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false', 'TENSORSTORE_GCS_HTTP_URL': self.url,
            'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'anon'}

  def names(self, bucket: str, prefix: str = '') -> list[str]:
    with self._lock:
      return sorted(n for b, n in self.objects if b == bucket and n.startswith(prefix))

  def copy_out(self, bucket: str, prefix: str, directory) -> None:
    """Writes the objects under ``prefix`` as files under the local ``directory``."""
    for name in self.names(bucket, prefix):
      target = os.path.join(directory, name[len(prefix):].lstrip('/'))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      with open(target, 'wb') as f:
        f.write(self.objects[(bucket, name)][0])

  def put(self, bucket: str, name: str, data: bytes) -> int:
    with self._lock:
      self._generation += 1
      self.objects[(bucket, name)] = (data, self._generation)
      return self._generation

  def hold(self, name: str, clients: set[str], timeout_s: float = 60.0) -> None:
    """Requests on object ``name`` are answered only once each of ``clients`` (the requests'
    ``userProject``: gcsfs's ``requester_pays``) has sent one, or ``timeout_s`` passed."""
    self._held[name] = (set(clients), threading.Event(), timeout_s)

  def _wait_if_held(self, name: str, client: str) -> None:
    with self._lock:
      held = self._held.get(name)
      if held is None:
        return
      waiting, arrived, timeout_s = held
      waiting.discard(client)
      if not waiting:
        del self._held[name]
        arrived.set()
    arrived.wait(timeout_s)

  def _meta(self, bucket: str, name: str) -> dict:
    data, generation = self.objects[(bucket, name)]
    return {'kind': 'storage#object', 'bucket': bucket, 'name': name, 'size': str(len(data)),
            'generation': str(generation), 'metageneration': '1',
            'contentType': 'application/octet-stream', 'storageClass': 'STANDARD',
            'timeCreated': '2026-01-01T00:00:00.000Z', 'updated': '2026-01-01T00:00:00.000Z'}


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def handle_error(self, request, client_address):
    if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up: not news
      super().handle_error(request, client_address)


def _handler(gcs: GCSEmulator):

  class Handler(http.server.BaseHTTPRequestHandler):
    """GET/POST/DELETE on /storage/v1/b/..., /download/storage/v1/b/..., /upload/storage/v1/b/..."""

    def log_message(self, *args):  # no line per request on stderr
      pass

    def _reply(self, status: int, body=b'', content_type='application/json', headers=None):
      if isinstance(body, dict):
        body = json.dumps(body).encode()
      self.send_response(status)
      for header, value in (headers or {}).items():
        self.send_header(header, value)
      self.send_header('Content-Type', content_type)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def _error(self, status: int, message: str):
      self._reply(status, {'error': {'code': status, 'message': message}})

    def _route(self):
      url = urllib.parse.urlsplit(self.path)
      query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
      m = re.fullmatch(r'(/download|/upload)?/storage/v1/b/([^/]+)(/o(?:/(.+))?)?', url.path)
      if m is None:
        return None
      kind, bucket, objects, name = m.groups()
      name = urllib.parse.unquote(name) if name else None
      return kind, bucket, objects, name, query

    def _precondition_fails(self, key, query) -> bool:
      """ifGenerationMatch / ifGenerationNotMatch against the live generation (0: none)."""
      live = gcs.objects.get(key)
      generation = live[1] if live else 0
      return (('ifGenerationMatch' in query and int(query['ifGenerationMatch']) != generation)
              or ('ifGenerationNotMatch' in query
                  and int(query['ifGenerationNotMatch']) == generation))

    def do_GET(self):
      kind, bucket, objects, name, query = self._route() or (None,) * 5
      if bucket is None:
        return self._error(404, 'no such route')
      if objects is None:
        return self._reply(200, {'kind': 'storage#bucket', 'name': bucket, 'id': bucket})
      if name is None:
        return self._reply(200, self._list(bucket, query))
      gcs._wait_if_held(name, query.get('userProject'))
      key = (bucket, name)
      with gcs._lock:
        if key not in gcs.objects or query.get('generation', str(gcs.objects[key][1])) != str(
            gcs.objects[key][1]):
          return self._error(404, f'No such object: {bucket}/{name}')
        data, generation = gcs.objects[key]
        if 'ifGenerationNotMatch' in query and int(query['ifGenerationNotMatch']) == generation:
          return self._reply(304)  # the reader's copy is current (tensorstore's cache)
        if self._precondition_fails(key, query):
          return self._error(412, 'Precondition Failed')
        if kind == '/download' or query.get('alt') == 'media':
          return self._media(data, generation)
        return self._reply(200, gcs._meta(bucket, name))

    def _media(self, data: bytes, generation: int):
      """The object's bytes, or the ``Range: bytes=a-b`` (``a-``, ``-n``) of them (206)."""
      headers = {'x-goog-generation': str(generation), 'x-goog-metageneration': '1'}
      status, wanted = 200, re.fullmatch(r'bytes=(\d*)-(\d*)', self.headers.get('Range', ''))
      if wanted:
        first, last = wanted.groups()
        start = max(0, len(data) - int(last)) if not first else int(first)
        end = len(data) - 1 if not first or not last else min(int(last), len(data) - 1)
        if start >= len(data) or start > end:
          return self._reply(416, b'', headers={'Content-Range': f'bytes */{len(data)}'})
        status, headers['Content-Range'] = 206, f'bytes {start}-{end}/{len(data)}'
        data = data[start:end + 1]
      return self._reply(status, data, 'application/octet-stream', headers)

    def _list(self, bucket, query) -> dict:
      """objects.list: prefix, delimiter, startOffset/endOffset, maxResults, pageToken (the last
      name of the previous page)."""
      prefix, delimiter = query.get('prefix', ''), query.get('delimiter')
      start, end = query.get('startOffset', ''), query.get('endOffset')
      after, room = query.get('pageToken'), int(query.get('maxResults', 1000))
      items, prefixes, last = [], set(), None
      with gcs._lock:
        names = sorted(n for b, n in gcs.objects if b == bucket)
      for name in names:
        if (not name.startswith(prefix) or name < start or (end and name >= end)
            or (after and name <= after)):
          continue
        rest = name[len(prefix):]
        folder = (f'{prefix}{rest.split(delimiter, 1)[0]}{delimiter}'
                  if delimiter and delimiter in rest else None)
        if folder not in prefixes:  # a new entry: a folder, or an object
          if len(items) + len(prefixes) == room:
            return {'kind': 'storage#objects', 'items': items, 'prefixes': sorted(prefixes),
                    'nextPageToken': last}
          if folder:
            prefixes.add(folder)
          else:
            with gcs._lock:
              if (bucket, name) in gcs.objects:
                items.append(gcs._meta(bucket, name))
        last = name
      return {'kind': 'storage#objects', 'items': items, 'prefixes': sorted(prefixes)}

    def do_POST(self):
      kind, bucket, _, name, query = self._route() or (None,) * 5
      body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
      copy = re.fullmatch(r'/storage/v1/b/([^/]+)/o/([^/]+)/(rewriteTo/b/([^/]+)|moveTo)/o/([^/]+)',
                          urllib.parse.urlsplit(self.path).path)
      if copy:  # gcsfs's copy (rewriteTo, done in one call) and rename (moveTo)
        bucket, source, how, target_bucket, target = map(urllib.parse.unquote, copy.groups(''))
        source, target = (bucket, source), (target_bucket or bucket, target)
        with gcs._lock:
          if source not in gcs.objects:
            return self._error(404, f'No such object: {"/".join(source)}')
          if self._precondition_fails(target, query):
            return self._error(412, 'Precondition Failed')
          gcs._generation += 1
          data = gcs.objects[source][0]
          gcs.objects[target] = (data, gcs._generation)
          if how == 'moveTo':
            del gcs.objects[source]
            return self._reply(200, gcs._meta(*target))
          return self._reply(200, {'kind': 'storage#rewriteResponse', 'done': True,
                                   'objectSize': str(len(data)),
                                   'totalBytesRewritten': str(len(data)),
                                   'resource': gcs._meta(*target)})
      if kind is None and name and name.endswith('/compose'):  # gcsfs's merge: an append
        sources = [s['name'] for s in json.loads(body)['sourceObjects']]
        with gcs._lock:
          if any((bucket, s) not in gcs.objects for s in sources):
            return self._error(404, f'No such object among {sources}')
          data = b''.join(gcs.objects[(bucket, s)][0] for s in sources)
        return self._finish(bucket, name[:-len('/compose')], query, data)
      if kind != '/upload':
        return self._error(501, 'only uploads and compose')
      if query.get('uploadType') == 'multipart':
        boundary = re.search(r'boundary="?([^";]+)', self.headers['Content-Type']).group(1)
        parts = [p.split(b'\n\n', 1)[1] for p in body.replace(b'\r\n', b'\n').split(
            b'--' + boundary.encode())[1:-1]]
        name = json.loads(parts[0])['name']
        gcs._wait_if_held(name, query.get('userProject'))
        return self._finish(bucket, name, query, parts[1][:-1])  # [:-1]: the newline before --
      if query.get('uploadType') == 'media':  # tensorstore: the name in the query, the body whole
        gcs._wait_if_held(query['name'], query.get('userProject'))
        return self._finish(bucket, query['name'], query, body)
      if query.get('uploadType') != 'resumable':
        return self._error(501, 'only media, multipart and resumable uploads')
      if 'upload_id' not in query:  # a resumable upload starts: -> its session's URL
        name = query.get('name') or json.loads(body)['name']
        gcs._wait_if_held(name, query.get('userProject'))
        with gcs._lock:
          gcs._generation += 1
          session = str(gcs._generation)
          gcs._sessions[session] = (name, query, bytearray())
        self.send_response(200)
        self.send_header('Location', f'{gcs.url}/upload/storage/v1/b/{bucket}/o?'
                                     f'uploadType=resumable&upload_id={session}')
        self.send_header('Content-Length', '0')
        return self.end_headers()
      name, first_query, data = gcs._sessions[query['upload_id']]
      data += body
      total = self.headers.get('Content-Range', '').rsplit('/', 1)[-1]
      if total == '*' or len(data) < int(total):  # more chunks to come
        self.send_response(308)
        self.send_header('Range', f'bytes=0-{len(data) - 1}')
        self.send_header('Content-Length', '0')
        return self.end_headers()
      del gcs._sessions[query['upload_id']]
      return self._finish(bucket, name, first_query, bytes(data))

    def _finish(self, bucket, name, query, data: bytes):
      """Stores an upload if its precondition holds (checked with the store locked)."""
      with gcs._lock:
        if self._precondition_fails((bucket, name), query):
          return self._error(412, 'Precondition Failed')
        gcs._generation += 1
        gcs.objects[(bucket, name)] = (data, gcs._generation)
        return self._reply(200, gcs._meta(bucket, name))

    do_PUT = do_POST

    def do_DELETE(self):
      _, bucket, _, name, query = self._route() or (None,) * 5
      if name is None:
        return self._error(404, 'no such route')
      gcs._wait_if_held(name, query.get('userProject'))
      key = (bucket, name)
      with gcs._lock:
        if key not in gcs.objects:
          return self._error(404, f'No such object: {bucket}/{name}')
        if self._precondition_fails(key, query):
          return self._error(412, 'Precondition Failed')
        del gcs.objects[key]
        return self._reply(204)

  return Handler
