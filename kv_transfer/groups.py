"""A channel's 2-rank process groups, built on its own TCPStore (no global init_process_group).

Rank 0 is the receiver (decode), which hosts the store on a port it has bound (port 0 ->
store.port); rank 1 is the sender (prefill). The control group is always gloo (CPU frames,
idle waits that must not trip a NCCL watchdog); the data group is the same gloo group, or a
ProcessGroupNCCL when both ends hold CUDA pools on distinct GPUs. Only the groups' own
send/recv are used. Whoever owns a ChannelGroups closes it (shutdown, or abort when broken).

Addresses: the store and the receiver's gloo pair listen on the receiver's host only (the
address it advertises); the sender's pair binds the address it reaches that host from. With
`interface` set (kv_transfer.interface), both sides use that interface's IPv4 address and
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name it, so NCCL's own sockets follow it too.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

RECEIVER_RANK, SENDER_RANK = 0, 1
JOINED_KEY = "sender_joined"
_DEVICE_POLL_S = 0.0002


class ChannelBroken(Exception):
    """The channel cannot be trusted any more (timeout, dead peer, protocol error)."""


@dataclass(frozen=True)
class DeviceInfo:
    type: str           # "cpu" | "cuda"
    uuid: str | None    # physical GPU identity, so two ends on one GPU are told apart

    @classmethod
    def of(cls, device: torch.device) -> DeviceInfo:
        if device.type != "cuda":
            return cls(device.type, None)
        return cls("cuda", str(torch.cuda.get_device_properties(device).uuid))


def resolve_backend(sender: str, receiver: str, sender_dev: DeviceInfo,
                    receiver_dev: DeviceInfo) -> str:
    """The data backend both ends will use; ValueError with the reason when there is none."""
    if "auto" not in (sender, receiver) and sender != receiver:
        raise ValueError(f"backend: sender forces {sender}, receiver forces {receiver}")
    forced = sender if sender != "auto" else receiver
    nccl_ok = (sender_dev.type == receiver_dev.type == "cuda"
               and sender_dev.uuid != receiver_dev.uuid and dist.is_nccl_available())
    if forced == "nccl" and not nccl_ok:
        raise ValueError(f"backend nccl needs CUDA pools on two distinct GPUs and a NCCL build; "
                         f"sender {sender_dev}, receiver {receiver_dev}")
    if forced == "gloo" or not nccl_ok:
        return "gloo"
    return "nccl"


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Receiver side: a store listening on `host` only (not every address of the node), on a
    port the OS picked and we now hold (store.port)."""
    family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind) as listener:
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        fd = listener.detach()   # the store owns the socket from here on
    try:
        # the libuv server never closes a socket handed in by fd: the port would stay bound
        # (and connectable) after the channel ends, one leaked listener per channel
        return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd, use_libuv=False)
    except BaseException:
        os.close(fd)
        raise


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host (what the peer can reach us at)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)   # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def interface_address(name: str) -> str:
    """The IPv4 address of this node's network interface `name`; ValueError listing the
    interfaces (and their addresses) the node does have when it has no such one."""
    address = _ipv4_of(name)
    if address is None:
        have = ", ".join(f"{n} {_ipv4_of(n) or '(no IPv4)'}" for _, n in socket.if_nameindex())
        raise ValueError(f"kv_transfer.interface {name!r} has no IPv4 address on this node "
                         f"(its interfaces: {have})")
    return address


def _ipv4_of(name: str) -> str | None:
    siocgifaddr = 0x8915   # Linux ioctl: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), siocgifaddr, request)[20:24])
        except OSError:
            return None


def use_interface(name: str | None) -> None:
    """Point gloo's and NCCL's own interface choice at kv_transfer.interface (the config wins
    over the environment: it is what the operator wrote for this cluster)."""
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = name


def gloo_group(store: dist.Store, rank: int, local_host: str,
               timeout_s: float) -> dist.ProcessGroupGloo:
    """Blocks until the other rank builds its side (or timeout)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, 2, options)


def nccl_group(store: dist.Store, rank: int, timeout_s: float) -> dist.ProcessGroup:
    # The watchdog's timeout is twice ours: our own timed waits fail first and abort the
    # group, so a dead peer fails a transfer instead of the watchdog tearing the worker down.
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=2 * timeout_s + 10)
    return dist.ProcessGroupNCCL(dist.PrefixStore("data/", store), rank, 2, options)


def wait_for(work: dist.Work, deadline: float, what: str) -> None:
    """Wait for one send/recv until `deadline` (time.monotonic()); ChannelBroken otherwise."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ChannelBroken(f"timed out before {what}")
    try:
        work.wait(timedelta(seconds=remaining))
    except RuntimeError as err:
        reason = short_error(err)
        if "timed out" in reason.lower() or "timeout" in reason.lower():
            reason = f"timed out after {remaining:.1f}s"
        raise ChannelBroken(f"{what}: {reason}") from err


def wait_on_device(work: dist.Work, deadline: float, what: str) -> None:
    """NCCL's work.wait() only orders the current stream (its timeout applies only under
    TORCH_NCCL_BLOCKING_WAIT), so poll for completion here: a stuck or dead peer then times
    out at our deadline, and the caller aborts the group to free the stuck kernels."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise ChannelBroken(f"{what}: timed out")
        time.sleep(_DEVICE_POLL_S)
    try:
        work.wait()   # raises the communicator's error, if any; orders the current stream
    except RuntimeError as err:
        raise ChannelBroken(f"{what}: {short_error(err)}") from err


@dataclass
class ChannelGroups:
    store: dist.TCPStore
    control: dist.ProcessGroupGloo
    data: dist.ProcessGroup
    backend: str
    peer_rank: int

    def attach_data(self, backend: str, rank: int, timeout_s: float, device: torch.device,
                    deadline: float) -> None:
        """Switch the data plane to NCCL once the handshake agreed on it, and warm it up:
        NCCL builds its p2p communicator on the first send/recv, which should not be
        charged to (or time out) the first transfer."""
        self.backend = backend
        if backend != "nccl":
            return
        self.data = nccl_group(self.store, rank, timeout_s)
        probe = torch.zeros(1, device=device)
        if rank == SENDER_RANK:
            self.wait_data(self.send(probe, 0, data=True), deadline, "warming up NCCL")
        else:
            self.wait_data(self.recv(probe, 0, data=True), deadline, "warming up NCCL")

    def send(self, tensor: torch.Tensor, tag: int, *, data: bool = False) -> dist.Work:
        """Post a send to the peer (control group unless data=True); ChannelBroken if the
        group is already broken (posting on a closed pair raises, not only waiting)."""
        group = self.data if data else self.control
        try:
            return group.send([tensor], self.peer_rank, tag)
        except RuntimeError as err:
            raise ChannelBroken(f"posting a send: {short_error(err)}") from err

    def recv(self, tensor: torch.Tensor, tag: int, *, data: bool = False) -> dist.Work:
        group = self.data if data else self.control
        try:
            return group.recv([tensor], self.peer_rank, tag)
        except RuntimeError as err:
            raise ChannelBroken(f"posting a receive: {short_error(err)}") from err

    def wait_data(self, work: dist.Work, deadline: float, what: str) -> None:
        """Wait for a data-plane send/recv, on the host (gloo) or on the device (NCCL)."""
        if self.backend == "nccl":
            wait_on_device(work, deadline, what)
        else:
            wait_for(work, deadline, what)

    def close(self, broken: bool) -> None:
        groups = [self.control] if self.data is self.control else [self.data, self.control]
        for group in groups:
            try:
                group.abort() if broken else group.shutdown()
            except RuntimeError as err:
                logger.warning("kv_transfer: closing a %s group failed: %s", self.backend,
                               short_error(err))


def short_error(err: BaseException) -> str:
    """First line of a c10d error, without the '[/path/file.cc:123] ' prefix."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line
