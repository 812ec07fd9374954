"""Cloud Storage's JSON API on 127.0.0.1, as much of it as gcsfs uses for small objects: bucket
and object metadata, listing, media download, multipart and resumable upload, delete, with generations and
the ifGenerationMatch precondition (HTTP 412), which the server checks atomically as Cloud Storage
does (https://cloud.google.com/storage/docs/request-preconditions).

A client reaches it with ``STORAGE_EMULATOR_HOST=<url>`` and ``FSSPEC_GS_TOKEN=anon`` (no
credentials, nothing leaves the machine). ``hold(name, clients)`` answers the requests on object
``name`` only once each client has sent one, so that racing clients really race: none is answered
before all have asked.

Used by tests/test_workdir_safety.py (the lock of a gs:// workdir, two processes contending).
"""

from __future__ import annotations

import http.server
import json
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

    def _reply(self, status: int, body=b'', content_type='application/json'):
      if isinstance(body, dict):
        body = json.dumps(body).encode()
      self.send_response(status)
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
      if 'ifGenerationMatch' not in query:
        return False
      live = gcs.objects.get(key)
      return int(query['ifGenerationMatch']) != (live[1] if live else 0)

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
        if kind == '/download' or query.get('alt') == 'media':
          return self._reply(200, gcs.objects[key][0], 'application/octet-stream')
        return self._reply(200, gcs._meta(bucket, name))

    def _list(self, bucket, query) -> dict:
      prefix, delimiter = query.get('prefix', ''), query.get('delimiter')
      items, prefixes = [], set()
      with gcs._lock:
        for b, name in sorted(gcs.objects):
          if b != bucket or not name.startswith(prefix):
            continue
          rest = name[len(prefix):]
          if delimiter and delimiter in rest:
            prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
          else:
            items.append(gcs._meta(bucket, name))
      return {'kind': 'storage#objects', 'items': items, 'prefixes': sorted(prefixes)}

    def do_POST(self):
      kind, bucket, _, _, query = self._route() or (None,) * 5
      body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
      if kind != '/upload':
        return self._error(501, 'only uploads')
      if query.get('uploadType') == 'multipart':
        boundary = re.search(r'boundary="?([^";]+)', self.headers['Content-Type']).group(1)
        parts = [p.split(b'\n\n', 1)[1] for p in body.replace(b'\r\n', b'\n').split(
            b'--' + boundary.encode())[1:-1]]
        name = json.loads(parts[0])['name']
        gcs._wait_if_held(name, query.get('userProject'))
        return self._finish(bucket, name, query, parts[1][:-1])  # [:-1]: the newline before --
      if query.get('uploadType') != 'resumable':
        return self._error(501, 'only multipart and resumable uploads')
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
