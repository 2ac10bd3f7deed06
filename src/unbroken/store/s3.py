"""S3 (and S3-compatible servers: MinIO, SeaweedFS, Ceph, R2, ...) through s3fs.

What S3 adds to :class:`~unbroken.store.fsspec.FsspecStore`:

- **Parallel multipart uploads.** A data file is cut into ``part_size`` parts as the
  writer produces it; each part is uploaded by the shared I/O pool with its own retries
  (a part upload is idempotent), and several files upload at the same time; at most ``workers``
  parts are in memory (8 × 64 MiB by default) and each byte is copied once, from the writer into its part.
  :meth:`FsspecStaging.commit` waits for every part, completes the uploads, then PUTs the
  manifest.
- **Conditional writes** for the run's lease (:mod:`.lease`): ``If-None-Match: *`` to
  create it and ``If-Match: <etag>`` to renew or take it over, so two writers can never
  both believe they hold it. Servers that ignore these headers are detected at first use
  (a second create of the same key succeeds) and the lease falls back to write-and-read-back.
- **Leftover multipart uploads** of a dead writer are aborted by the next one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..errors import StorageError
from .fsspec import FsspecStore
from .retry import Retry
from .upload import FsspecStaging

log = logging.getLogger("unbroken")


class S3Store(FsspecStore):
    """A run at ``s3://bucket/prefix``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inflight = threading.BoundedSemaphore(self.workers)
        self.conditional: bool | None = None  # learnt by the lease on first use

    def split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def s3(self, what: str, method: str, **kwargs: Any) -> Any:
        return self.call(what, self.fs.call_s3, method, **kwargs)

    def check(self, deadline_s: float = 15.0) -> None:
        bucket = self.root.split("/")[0]
        try:
            quick = Retry(deadline_s=min(self.retry.deadline_s, deadline_s))
            quick.call(f"check ({self.url})", lambda: self.fs.call_s3("head_bucket", Bucket=bucket))
        except FileNotFoundError:
            raise StorageError(f"{self.url}: the bucket {bucket!r} does not exist; create it first "
                               "(unbroken never creates buckets)") from None
        except PermissionError as e:
            raise StorageError(f"{self.url}: access denied ({e}); check the credentials (storage_options "
                               "key/secret/profile, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
                               "AWS_PROFILE)") from None
        except Exception as e:  # noqa: BLE001 - any backend error: one clear StorageError
            text = f"{type(e).__name__}: {e}"
            if "credentials" in text.lower():
                raise StorageError(f"{self.url}: no credentials found ({text}); pass storage_options="
                                   "{'key': ..., 'secret': ...} or {'anon': True}, or set AWS_* variables") from None
            raise StorageError(f"{self.url}: cannot reach the S3 endpoint: {text}") from None

    def open_writer(self, path: str, staging: FsspecStaging) -> Any:
        return _MultipartWriter(self, path, staging)

    def put(self, path: str, data: bytes | bytearray) -> None:
        bucket, key = self.split(path)
        self.s3("upload", "put_object", Bucket=bucket, Key=key, Body=data)

    def put_chunk(self, cid: str, data: Any) -> None:
        """One PUT, or a multipart upload for a large chunk (invisible until completed)."""
        holder = FsspecStaging(self, "chunks", joined=True)  # collects the part uploads
        writer = self.open_writer(f"{self.chunk_root}/{cid}", holder)
        holder.writers.append(writer)
        try:
            writer.write(data)
            writer.close()
            holder.flush()
        except BaseException:
            holder.abort()
            raise

    def clean_stale(self) -> list[str]:
        removed = super().clean_stale()
        bucket, prefix = self.split(self.root + "/")
        try:
            listing = self.s3("list uploads", "list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            for up in listing.get("Uploads", []):
                self.s3("abort upload", "abort_multipart_upload", Bucket=bucket, Key=up["Key"],
                        UploadId=up["UploadId"])
                removed.append(f"multipart upload of {up['Key']}")
        except Exception as e:  # noqa: BLE001 - not every S3-compatible server lists uploads
            log.debug("could not list multipart uploads under %s: %s", self.url, e)
        return removed

    # -------------------------------------------------- conditional writes (lease)
    def get_with_etag(self, path: str) -> tuple[bytes, str] | None:
        bucket, key = self.split(path)
        try:
            out = self.s3("read lease", "get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return _read_body(self.fs, out["Body"]), out["ETag"]

    def put_conditional(self, path: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """PUT that succeeds only if the object is absent (``if_match=None``) or still has
        that ETag; the new ETag, or None if the precondition failed."""
        bucket, key = self.split(path)
        cond = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        try:
            out = self.s3("write lease", "put_object", Bucket=bucket, Key=key, Body=data, **cond)
        except OSError as e:  # s3fs turns 412 PreconditionFailed / 409 ConditionalRequestConflict into OSError
            if "condition" in str(e).lower():
                return None
            raise
        return out.get("ETag")

    def delete_conditional(self, path: str, etag: str) -> None:
        """Delete ``path`` only while it still has ``etag`` (the lease is still ours): never a
        lease another writer took over meanwhile."""
        bucket, key = self.split(path)
        try:
            self.s3("release lease", "delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        except FileNotFoundError:
            return
        except OSError as e:
            if "condition" in str(e).lower():  # 412 / 409: another writer's lease now, not ours to delete
                return
            # If-Match on DELETE is recent (servers that do not know it refuse it): check, then delete
            try:
                head = self.s3("release lease", "head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return
            if head.get("ETag") == etag:
                self.s3("release lease", "delete_object", Bucket=bucket, Key=key)


def _read_body(fs: Any, body: Any) -> bytes:
    """Read an aiobotocore streaming body on s3fs's event loop."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        async with body as stream:
            return await stream.read()

    return sync(fs.loop, read)


class _MultipartWriter:
    """One data object, uploaded part by part in the background (see the module docstring)."""

    def __init__(self, store: S3Store, path: str, staging: FsspecStaging) -> None:
        self.store, self.path, self.staging = store, path, staging
        self.bucket, self.key = store.split(path)
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.parts: dict[int, str] = {}
        self.count = 0
        self.closed = False

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        size = self.store.part_size
        while len(mv):
            take = min(len(mv), size - len(self.buf))
            self.buf += mv[:take]
            mv = mv[take:]
            if len(self.buf) == size:
                self._submit_part()
        return len(data) if not isinstance(data, memoryview) else data.nbytes

    def flush(self) -> None:
        pass

    def _submit_part(self) -> None:
        if self.upload_id is None:
            out = self.store.s3("start upload", "create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.upload_id = out["UploadId"]
        self.count += 1
        number, data, self.buf = self.count, self.buf, bytearray()  # handed over, not copied
        self.store._inflight.acquire()  # backpressure: bounded parts in memory

        def upload() -> None:
            try:
                out = self.store.s3(f"upload part {number} of {self.key}", "upload_part", Bucket=self.bucket,
                                    Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=data)
                self.parts[number] = out["ETag"]
            finally:
                self.store._inflight.release()

        self.staging.futures.append(self.store.pool().submit(upload))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.upload_id is None:  # small file: one PUT, in the background
            data, self.buf = self.buf, bytearray()
            self.staging.futures.append(self.store.pool().submit(self.store.put, self.path, data))
        elif self.buf:
            self._submit_part()

    def finish(self) -> None:
        """Complete the multipart upload (after every part finished)."""
        if self.upload_id is None:
            return
        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self.parts.items())]
        self.store.s3(f"complete upload of {self.key}", "complete_multipart_upload", Bucket=self.bucket,
                      Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": parts})
        self.upload_id = None

    def abort(self) -> None:
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            self.store.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)

    def __enter__(self) -> _MultipartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
