"""data_runs: which bytes of a memfd hold data, so that pre-faulting touches no hole."""

import os

from lmcache_mp.memory import data_runs

PAGE = 4096


def test_data_runs_are_the_written_pages_within_the_window_and_the_offset_is_kept():
    fd = os.memfd_create("runs", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 64 * PAGE)
        for page in (0, 2, 3, 10):
            os.pwrite(fd, b"x", page * PAGE)
        os.lseek(fd, 5, os.SEEK_SET)
        assert data_runs(fd, 0, 64 * PAGE, 100) == [(0, PAGE), (2 * PAGE, 2 * PAGE),
                                                     (10 * PAGE, PAGE)]
        assert data_runs(fd, PAGE, 3 * PAGE, 100) == [(2 * PAGE, PAGE)]  # cut to the window
        assert data_runs(fd, 0, 64 * PAGE, 2) == [(0, PAGE), (2 * PAGE, 2 * PAGE)]
        assert data_runs(fd, 11 * PAGE, 64 * PAGE, 100) == []  # only holes
        assert data_runs(fd, 4 * PAGE, 10 * PAGE, 100) == []
        assert os.lseek(fd, 0, os.SEEK_CUR) == 5  # the file's shared offset, as it was
    finally:
        os.close(fd)
