// Asynchronous file I/O between host tensors and files (AsyncIOBuilder, module "async_io").
//
// What: an aio_handle reads a file region into a CPU tensor or writes a tensor's bytes to a file, synchronously
// or in the background (async_* then wait()). Each request is cut into intra_op_parallelism contiguous parts,
// one per worker thread, and each part into block_size pieces.
// Backends: "libaio" (kernel AIO, up to queue_depth pieces in flight per worker; compiled only when the libaio
// headers were found: DS_AIO_HAVE_LIBAIO) or "threads" (blocking pread/pwrite calls; each worker's part is cut
// again into min(queue_depth, kMaxLanes) lanes, one thread each, so that this backend too keeps queue_depth
// requests in flight: an NVMe device reaches its throughput only with several in flight).
// O_DIRECT: used where the file system accepts it (not tmpfs, for example). Direct I/O needs the memory address,
// the file offset and the length aligned to kAlign; pieces whose memory is not aligned go through an aligned
// bounce buffer, and a tail shorter than kAlign goes through a second, buffered descriptor of the same file.
// Errors: a failed or short transfer raises (at the sync call, or at wait() for async requests) with the path,
// the offset, the bytes asked for and the system's reason; a read past the end of the file never yields zeros.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/extension.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef DS_AIO_HAVE_LIBAIO
#include <libaio.h>
#endif

namespace {

constexpr int64_t kAlign = 4096;
constexpr int kMaxLanes = 16;    // threads backend: blocking calls in flight per intra-op worker, at most
constexpr int kMaxWorkers = 64;  // threads of one handle's pool, at most

int64_t round_down(int64_t v, int64_t a) { return v / a * a; }
bool aligned(int64_t v) { return v % kAlign == 0; }

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Both descriptors of one file: direct (may equal buffered when O_DIRECT is refused) and buffered.
struct FilePair {
    int direct = -1;
    int buffered = -1;
    bool has_direct = false;
    std::string path;
    ~FilePair() {
        if (has_direct && direct >= 0) close(direct);
        if (buffered >= 0) close(buffered);
    }
};

std::shared_ptr<FilePair> open_pair(const std::string& path, bool write, bool try_direct) {
    auto f = std::make_shared<FilePair>();
    f->path = path;
    const int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
    f->buffered = open(path.c_str(), flags, 0644);
    if (f->buffered < 0) {
        const int err = errno;
        throw std::runtime_error("cannot open " + path + (write ? " for writing: " : " for reading: ") +
                                 errno_text(err));
    }
    if (try_direct) {
        f->direct = open(path.c_str(), flags | O_DIRECT, 0644);
        f->has_direct = f->direct >= 0;
    }
    if (!f->has_direct) f->direct = f->buffered;
    return f;
}

// One contiguous byte range of a request, handled by one worker.
struct Part {
    char* buf;
    int64_t nbytes;
    int64_t offset;  // in the file
};

struct Request {
    std::shared_ptr<FilePair> file;
    bool write;
    int64_t total;
    std::atomic<int> parts_left{0};
    std::mutex mu;
    std::string error;
    void fail(const std::string& msg) {
        std::lock_guard<std::mutex> g(mu);
        if (error.empty()) error = msg;
    }
};

std::string io_error(const Request& r, int64_t offset, int64_t want, const std::string& why) {
    std::ostringstream s;
    s << (r.write ? "writing " : "reading ") << want << " bytes " << (r.write ? "to " : "from ") << r.file->path
      << " at offset " << offset << " failed: " << why;
    if (r.write) s << "; " << want << " more bytes are needed on that file system";
    return s.str();
}

// Blocking transfer of [buf, buf+n) at offset through fd, looping over partial transfers.
void blocking_io(const Request& r, int fd, char* buf, int64_t n, int64_t offset) {
    int64_t done = 0;
    while (done < n) {
        const ssize_t got = r.write ? pwrite(fd, buf + done, n - done, offset + done)
                                    : pread(fd, buf + done, n - done, offset + done);
        if (got < 0) {
            if (errno == EINTR) continue;
            throw std::runtime_error(io_error(r, offset + done, n - done, errno_text(errno)));
        }
        if (got == 0) {
            throw std::runtime_error(io_error(r, offset + done, n - done,
                                              r.write ? "no progress" : "the file ends early (truncated?)"));
        }
        done += got;
    }
}

struct Settings {
    int64_t block_size;
    int queue_depth;
    bool single_submit;
    bool overlap_events;
    int threads;
    bool use_libaio;
};

// Per-worker aligned bounce buffers for pieces whose memory address is not aligned.
struct Bounce {
    std::vector<char*> bufs;
    int64_t size = 0;
    void ensure(int count, int64_t bytes) {
        if (static_cast<int>(bufs.size()) >= count && size >= bytes) return;
        release();
        size = bytes;
        for (int i = 0; i < count; ++i) {
            void* p = nullptr;
            if (posix_memalign(&p, kAlign, bytes) != 0) throw std::runtime_error("out of memory for I/O buffers");
            bufs.push_back(static_cast<char*>(p));
        }
    }
    void release() {
        for (char* p : bufs) free(p);
        bufs.clear();
    }
    ~Bounce() { release(); }
};

// A piece of a part: aligned for direct I/O (or done buffered), staged through bounce buffer `slot` when needed.
struct Piece {
    char* user;
    int64_t n;
    int64_t offset;
    bool direct;
    bool staged;
};

std::vector<Piece> plan_pieces(const Request& r, const Part& p, int64_t block) {
    std::vector<Piece> out;
    const bool can_direct = r.file->has_direct && aligned(p.offset);
    const int64_t direct_len = can_direct ? round_down(p.nbytes, kAlign) : 0;
    for (int64_t pos = 0; pos < direct_len; pos += block) {
        const int64_t n = std::min(block, direct_len - pos);
        char* user = p.buf + pos;
        const bool staged = reinterpret_cast<uintptr_t>(user) % kAlign != 0;
        out.push_back({user, n, p.offset + pos, true, staged});
    }
    if (direct_len < p.nbytes) {
        for (int64_t pos = direct_len; pos < p.nbytes; pos += block) {
            const int64_t n = std::min(block, p.nbytes - pos);
            out.push_back({p.buf + pos, n, p.offset + pos, false, false});
        }
    }
    return out;
}

void run_threads(const Request& r, const Part& p, const Settings& s, Bounce& bounce) {
    for (const Piece& pc : plan_pieces(r, p, s.block_size)) {
        if (!pc.direct) {
            blocking_io(r, r.file->buffered, pc.user, pc.n, pc.offset);
        } else if (!pc.staged) {
            blocking_io(r, r.file->direct, pc.user, pc.n, pc.offset);
        } else {
            bounce.ensure(1, s.block_size);
            if (r.write) std::memcpy(bounce.bufs[0], pc.user, pc.n);
            blocking_io(r, r.file->direct, bounce.bufs[0], pc.n, pc.offset);
            if (!r.write) std::memcpy(pc.user, bounce.bufs[0], pc.n);
        }
    }
}

#ifdef DS_AIO_HAVE_LIBAIO
void run_libaio(const Request& r, const Part& p, const Settings& s, Bounce& bounce, io_context_t ctx) {
    std::vector<Piece> pieces = plan_pieces(r, p, s.block_size);
    std::vector<Piece> queued;
    for (const Piece& pc : pieces) {
        if (pc.direct) queued.push_back(pc);
        else blocking_io(r, r.file->buffered, pc.user, pc.n, pc.offset);  // the unaligned tail
    }
    const int depth = std::max(1, s.queue_depth);
    bounce.ensure(depth, s.block_size);
    std::vector<iocb> cbs(depth);
    std::vector<int> free_slots;
    for (int i = depth - 1; i >= 0; --i) free_slots.push_back(i);
    std::vector<io_event> events(depth);
    size_t next = 0;
    int in_flight = 0;
    std::string failure;
    while (next < queued.size() || in_flight > 0) {
        std::vector<iocb*> batch;
        while (next < queued.size() && !free_slots.empty() && failure.empty()) {
            const int slot = free_slots.back();
            free_slots.pop_back();
            const Piece& pc = queued[next++];
            char* mem = pc.staged ? bounce.bufs[slot] : pc.user;
            if (pc.staged && r.write) std::memcpy(mem, pc.user, pc.n);
            if (r.write) io_prep_pwrite(&cbs[slot], r.file->direct, mem, pc.n, pc.offset);
            else io_prep_pread(&cbs[slot], r.file->direct, mem, pc.n, pc.offset);
            cbs[slot].data = reinterpret_cast<void*>(static_cast<intptr_t>(next - 1));
            batch.push_back(&cbs[slot]);
            if (s.single_submit) {
                const int rc = io_submit(ctx, 1, &batch.back());
                if (rc != 1) failure = io_error(r, pc.offset, pc.n, "io_submit: " + errno_text(rc < 0 ? -rc : EIO));
                else ++in_flight;
                batch.clear();
            }
        }
        if (!batch.empty()) {
            const int rc = io_submit(ctx, static_cast<long>(batch.size()), batch.data());
            if (rc < 0) failure = io_error(r, p.offset, p.nbytes, "io_submit: " + errno_text(-rc));
            else in_flight += rc;
            if (rc >= 0 && rc < static_cast<int>(batch.size()))
                failure = io_error(r, p.offset, p.nbytes, "io_submit accepted only part of the batch");
        }
        if (in_flight == 0) break;
        // overlap_events: refill as soon as one piece completes; otherwise drain the whole batch first.
        const int want = s.overlap_events ? 1 : in_flight;
        const int got = io_getevents(ctx, want, depth, events.data(), nullptr);
        if (got < 0) {
            if (got == -EINTR) continue;
            throw std::runtime_error(io_error(r, p.offset, p.nbytes, "io_getevents: " + errno_text(-got)));
        }
        for (int e = 0; e < got; ++e) {
            iocb* cb = events[e].obj;
            const int slot = static_cast<int>(cb - cbs.data());
            const Piece& pc = queued[static_cast<size_t>(reinterpret_cast<intptr_t>(cb->data))];
            const long res = static_cast<long>(events[e].res);
            if (res < 0) failure = io_error(r, pc.offset, pc.n, errno_text(static_cast<int>(-res)));
            else if (res != pc.n) {
                // A short direct transfer: finish it with blocking calls (the file may end inside it).
                try {
                    char* mem = pc.staged ? bounce.bufs[slot] : pc.user;
                    blocking_io(r, r.file->buffered, mem + res, pc.n - res, pc.offset + res);
                } catch (const std::exception& ex) {
                    failure = ex.what();
                }
            }
            if (pc.staged && !r.write && failure.empty()) std::memcpy(pc.user, bounce.bufs[slot], pc.n);
            free_slots.push_back(slot);
            --in_flight;
        }
    }
    if (!failure.empty()) throw std::runtime_error(failure);
}
#endif

class ThreadPool {
public:
    explicit ThreadPool(int n) {
        for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
    }
    ~ThreadPool() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    // Queue one task per worker index (task i runs on worker i, so per-worker state needs no lock).
    void submit(int worker, std::function<void(int)> fn) {
        {
            std::lock_guard<std::mutex> g(mu_);
            queues_[worker].push_back(std::move(fn));
        }
        cv_.notify_all();
    }
    int size() const { return static_cast<int>(workers_.size()); }
    std::vector<std::deque<std::function<void(int)>>> queues_{kMaxWorkers};

private:
    void loop(int index) {
        for (;;) {
            std::function<void(int)> fn;
            {
                std::unique_lock<std::mutex> l(mu_);
                cv_.wait(l, [&] { return stop_ || !queues_[index].empty(); });
                if (queues_[index].empty()) return;
                fn = std::move(queues_[index].front());
                queues_[index].pop_front();
            }
            fn(index);
        }
    }
    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
};

std::mutex g_pinned_mu;
std::set<void*> g_pinned;

}  // namespace

class AioHandle {
public:
    AioHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
              int64_t intra_op_parallelism, const std::string& backend)
        : settings_{block_size, static_cast<int>(queue_depth), single_submit, overlap_events,
                    static_cast<int>(intra_op_parallelism), false} {
        TORCH_CHECK_VALUE(block_size > 0 && block_size % kAlign == 0, "aio_handle: block_size must be a positive ",
                          "multiple of ", kAlign, " bytes; got ", block_size);
        TORCH_CHECK_VALUE(queue_depth > 0, "aio_handle: queue_depth must be > 0; got ", queue_depth);
        TORCH_CHECK_VALUE(intra_op_parallelism > 0 && intra_op_parallelism <= 64,
                          "aio_handle: intra_op_parallelism must be in [1, 64]; got ", intra_op_parallelism);
        if (backend == "libaio" || backend == "auto") {
#ifdef DS_AIO_HAVE_LIBAIO
            settings_.use_libaio = true;
#else
            TORCH_CHECK_VALUE(backend == "auto", "aio_handle: backend 'libaio' was not compiled in (the libaio ",
                              "headers were not found at build time); use 'threads' or 'auto'");
#endif
        } else {
            TORCH_CHECK_VALUE(backend == "threads", "aio_handle: backend must be 'auto', 'libaio' or 'threads'; got '",
                              backend, "'");
        }
        // The threads backend keeps its queue depth with threads of its own (Backends, at the top of this file).
        lanes_ = settings_.use_libaio ? 1 : std::max(1, std::min(settings_.queue_depth, kMaxLanes));
        lanes_ = std::max(1, std::min(lanes_, kMaxWorkers / settings_.threads));
        const int n = settings_.threads * lanes_;
        bounce_.resize(n);
#ifdef DS_AIO_HAVE_LIBAIO
        ctx_.assign(n, nullptr);
        if (settings_.use_libaio) {
            for (int i = 0; i < n; ++i) {
                const int rc = io_setup(settings_.queue_depth, &ctx_[i]);
                TORCH_CHECK(rc == 0, "aio_handle: io_setup(", settings_.queue_depth, ") failed: ", errno_text(-rc));
            }
        }
#endif
        pool_ = std::make_unique<ThreadPool>(n);
    }
    ~AioHandle() {
        pool_.reset();
#ifdef DS_AIO_HAVE_LIBAIO
        for (auto c : ctx_)
            if (c) io_destroy(c);
#endif
    }

    int64_t get_block_size() const { return settings_.block_size; }
    int64_t get_queue_depth() const { return settings_.queue_depth; }
    bool get_single_submit() const { return settings_.single_submit; }
    bool get_overlap_events() const { return settings_.overlap_events; }
    int64_t get_intra_op_parallelism() const { return settings_.threads; }
    int64_t get_alignment() const { return kAlign; }
    std::string get_backend() const { return settings_.use_libaio ? "libaio" : "threads"; }

    int64_t submit(const torch::Tensor& buffer, const std::string& path, bool write, bool is_async, int64_t offset,
                   int parts) {
        TORCH_CHECK_VALUE(buffer.device().is_cpu(), "aio_handle: the buffer must be a CPU tensor; got ",
                          buffer.device());
        TORCH_CHECK_VALUE(buffer.is_contiguous(), "aio_handle: the buffer must be contiguous");
        TORCH_CHECK_VALUE(offset >= 0, "aio_handle: file_offset must be >= 0; got ", offset);
        const int64_t nbytes = buffer.numel() * buffer.element_size();
        auto req = std::make_shared<Request>();
        req->write = write;
        req->total = nbytes;
        req->file = open_pair(path, write, true);
        if (!write) check_size(*req, offset + nbytes);
        auto* base = static_cast<char*>(buffer.data_ptr());
        std::vector<Part> cut = split(base, nbytes, offset, parts * lanes_);
        req->parts_left = static_cast<int>(cut.size());
        if (is_async) {
            std::lock_guard<std::mutex> g(mu_);
            pending_.push_back({req, buffer});
        }
        for (size_t i = 0; i < cut.size(); ++i) {
            Part part = cut[i];
            pool_->submit(static_cast<int>(i), [this, req, part](int worker) { run_part(req, part, worker); });
        }
        if (is_async) return 0;
        // A blocking call waits for its own request only; earlier async requests stay for wait().
        const std::string error = finish(*req);
        if (!error.empty()) throw std::runtime_error(error);
        return 1;
    }

    int64_t submit_fd(const torch::Tensor& buffer, int64_t fd, int64_t offset) {
        TORCH_CHECK_VALUE(buffer.device().is_cpu() && buffer.is_contiguous(),
                          "aio_handle: the buffer must be a contiguous CPU tensor");
        auto req = std::make_shared<Request>();
        req->write = true;
        req->total = buffer.numel() * buffer.element_size();
        req->file = std::make_shared<FilePair>();
        req->file->buffered = dup(static_cast<int>(fd));
        TORCH_CHECK(req->file->buffered >= 0, "aio_handle: bad file descriptor ", fd);
        req->file->direct = req->file->buffered;
        req->file->path = "<fd " + std::to_string(fd) + ">";
        req->parts_left = 1;
        {
            std::lock_guard<std::mutex> g(mu_);
            pending_.push_back({req, buffer});
        }
        Part part{static_cast<char*>(buffer.data_ptr()), req->total, offset};
        pool_->submit(0, [this, req, part](int worker) { run_part(req, part, worker); });
        return 0;
    }

    // Completes every submitted request; returns how many completed; raises the first failure.
    int64_t wait() {
        std::vector<Pending> batch;
        {
            std::lock_guard<std::mutex> g(mu_);
            batch.swap(pending_);
        }
        std::string first_error;
        for (auto& p : batch) {
            const std::string error = finish(*p.req);
            if (first_error.empty()) first_error = error;
        }
        if (!first_error.empty()) throw std::runtime_error(first_error);
        return static_cast<int64_t>(batch.size());
    }

private:
    struct Pending {
        std::shared_ptr<Request> req;
        torch::Tensor keep_alive;  // the buffer must outlive its transfer
    };

    std::string finish(Request& r) {
        std::unique_lock<std::mutex> l(done_mu_);
        done_cv_.wait(l, [&] { return r.parts_left.load() == 0; });
        std::lock_guard<std::mutex> g(r.mu);
        return r.error;
    }

    static void check_size(const Request& r, int64_t need) {
        struct stat st;
        if (fstat(r.file->buffered, &st) != 0) throw std::runtime_error("cannot stat " + r.file->path);
        if (st.st_size < need) {
            std::ostringstream s;
            s << "reading " << r.total << " bytes from " << r.file->path << " failed: the file holds " << st.st_size
              << " bytes but " << need << " are expected (truncated or replaced?)";
            throw std::runtime_error(s.str());
        }
    }

    // Cut [0, nbytes) into up to `parts` ranges whose boundaries are multiples of kAlign.
    static std::vector<Part> split(char* base, int64_t nbytes, int64_t offset, int parts) {
        std::vector<Part> out;
        if (nbytes == 0) {
            out.push_back({base, 0, offset});
            return out;
        }
        int64_t per = (nbytes + parts - 1) / parts;
        per = std::max<int64_t>(kAlign, (per + kAlign - 1) / kAlign * kAlign);
        for (int64_t pos = 0; pos < nbytes; pos += per) out.push_back({base + pos, std::min(per, nbytes - pos), offset + pos});
        return out;
    }

    void run_part(const std::shared_ptr<Request>& req, const Part& part, int worker) {
        try {
#ifdef DS_AIO_HAVE_LIBAIO
            if (settings_.use_libaio) run_libaio(*req, part, settings_, bounce_[worker], ctx_[worker]);
            else run_threads(*req, part, settings_, bounce_[worker]);
#else
            run_threads(*req, part, settings_, bounce_[worker]);
#endif
        } catch (const std::exception& ex) {
            req->fail(ex.what());
        }
        {
            std::lock_guard<std::mutex> g(done_mu_);
            req->parts_left -= 1;
        }
        done_cv_.notify_all();
    }

    Settings settings_;
    int lanes_ = 1;  // parts per intra-op worker: the threads backend's requests in flight per worker
    std::vector<Bounce> bounce_;
#ifdef DS_AIO_HAVE_LIBAIO
    std::vector<io_context_t> ctx_;
#endif
    std::unique_ptr<ThreadPool> pool_;
    std::mutex mu_;
    std::vector<Pending> pending_;
    std::mutex done_mu_;
    std::condition_variable done_cv_;
};

namespace {

bool validate_file(const torch::Tensor& buffer, const std::string& path, int64_t offset) {
    const int64_t n = buffer.numel() * buffer.element_size();
    std::vector<char> got(static_cast<size_t>(n));
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) return false;
    int64_t done = 0;
    while (done < n) {
        const ssize_t r = pread(fd, got.data() + done, n - done, offset + done);
        if (r <= 0) break;
        done += r;
    }
    close(fd);
    return done == n && std::memcmp(got.data(), buffer.data_ptr(), n) == 0;
}

int64_t checked(AioHandle& h, const torch::Tensor& buf, const std::string& path, bool write, bool validate,
                bool is_async, int64_t offset, int parts) {
    const int64_t n = h.submit(buf, path, write, is_async, offset, parts);
    if (validate && !is_async) {
        TORCH_CHECK(validate_file(buf, path, offset), "aio_handle: validation failed: the bytes of ", path,
                    " at offset ", offset, " differ from the buffer");
    }
    return n;
}

torch::Tensor new_locked(int64_t num_elem, const torch::Tensor& example) {
    TORCH_CHECK_VALUE(num_elem >= 0, "new_cpu_locked_tensor: num_elem must be >= 0");
    const int64_t bytes = std::max<int64_t>(kAlign, (num_elem * example.element_size() + kAlign - 1) / kAlign * kAlign);
    void* p = nullptr;
    TORCH_CHECK(posix_memalign(&p, kAlign, bytes) == 0, "new_cpu_locked_tensor: out of memory for ", bytes, " bytes");
    const bool locked = mlock(p, bytes) == 0;  // best effort: RLIMIT_MEMLOCK may forbid it
    {
        std::lock_guard<std::mutex> g(g_pinned_mu);
        g_pinned.insert(p);
    }
    auto deleter = [bytes, locked](void* ptr) {
        {
            std::lock_guard<std::mutex> g(g_pinned_mu);
            g_pinned.erase(ptr);
        }
        if (locked) munlock(ptr, bytes);
        free(ptr);
    };
    return torch::from_blob(p, {num_elem}, deleter, example.options().device(torch::kCPU));
}

bool is_locked(const torch::Tensor& t) {
    std::lock_guard<std::mutex> g(g_pinned_mu);
    return g_pinned.count(const_cast<void*>(t.storage().data())) > 0;
}

bool libaio_compiled() {
#ifdef DS_AIO_HAVE_LIBAIO
    return true;
#else
    return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    namespace py = pybind11;
    using py::arg;
    py::class_<AioHandle>(m, "aio_handle")
        .def(py::init<int64_t, int64_t, bool, bool, int64_t, const std::string&>(), arg("block_size") = 1048576,
             arg("queue_depth") = 128, arg("single_submit") = false, arg("overlap_events") = false,
             arg("intra_op_parallelism") = 1, py::kw_only(), arg("backend") = "auto")
        .def("get_block_size", &AioHandle::get_block_size)
        .def("get_queue_depth", &AioHandle::get_queue_depth)
        .def("get_single_submit", &AioHandle::get_single_submit)
        .def("get_overlap_events", &AioHandle::get_overlap_events)
        .def("get_intra_op_parallelism", &AioHandle::get_intra_op_parallelism)
        .def("get_alignment", &AioHandle::get_alignment)
        .def("get_backend", &AioHandle::get_backend)
        .def(
            "read",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, bool validate, int64_t off) {
                py::gil_scoped_release nogil;
                return checked(h, b, f, false, validate, false, off, 1);
            },
            arg("buffer"), arg("filename"), arg("validate"), arg("file_offset") = 0)
        .def(
            "write",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, bool validate, int64_t off) {
                py::gil_scoped_release nogil;
                return checked(h, b, f, true, validate, false, off, 1);
            },
            arg("buffer"), arg("filename"), arg("validate"), arg("file_offset") = 0)
        .def(
            "pread",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, bool validate, bool is_async, int64_t off) {
                py::gil_scoped_release nogil;
                return checked(h, b, f, false, validate, is_async, off, h.get_intra_op_parallelism());
            },
            arg("buffer"), arg("filename"), arg("validate"), arg("async"), arg("file_offset") = 0)
        .def(
            "pwrite",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, bool validate, bool is_async, int64_t off) {
                py::gil_scoped_release nogil;
                return checked(h, b, f, true, validate, is_async, off, h.get_intra_op_parallelism());
            },
            arg("buffer"), arg("filename"), arg("validate"), arg("async"), arg("file_offset") = 0)
        .def(
            "sync_pread",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t off) {
                py::gil_scoped_release nogil;
                return h.submit(b, f, false, false, off, h.get_intra_op_parallelism());
            },
            arg("buffer"), arg("filename"), arg("file_offset") = 0)
        .def(
            "sync_pwrite",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t off) {
                py::gil_scoped_release nogil;
                return h.submit(b, f, true, false, off, h.get_intra_op_parallelism());
            },
            arg("buffer"), arg("filename"), arg("file_offset") = 0)
        .def(
            "async_pread",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t off) {
                py::gil_scoped_release nogil;
                return h.submit(b, f, false, true, off, h.get_intra_op_parallelism());
            },
            arg("buffer"), arg("filename"), arg("file_offset") = 0)
        .def(
            "async_pwrite",
            [](AioHandle& h, const torch::Tensor& b, const std::string& f, int64_t off) {
                py::gil_scoped_release nogil;
                return h.submit(b, f, true, true, off, h.get_intra_op_parallelism());
            },
            arg("buffer"), arg("filename"), arg("file_offset") = 0)
        .def(
            "async_pwrite",
            [](AioHandle& h, const torch::Tensor& b, int64_t fd, int64_t off) {
                py::gil_scoped_release nogil;
                return h.submit_fd(b, fd, off);
            },
            arg("buffer"), arg("fd"), arg("file_offset") = 0)
        .def(
            "wait",
            [](AioHandle& h) {
                py::gil_scoped_release nogil;
                return h.wait();
            })
        .def(
            "new_cpu_locked_tensor",
            [](AioHandle&, int64_t n, const torch::Tensor& ex) { return new_locked(n, ex); }, arg("num_elem"),
            arg("example_tenosr"))
        .def(
            "free_cpu_locked_tensor", [](AioHandle&, const torch::Tensor& t) { return is_locked(t); }, arg("tensor"))
        .def(
            "is_pinned", [](AioHandle&, const torch::Tensor& t) { return t.is_pinned() || is_locked(t); },
            arg("buffer"));

    auto one_shot = [](bool write) {
        return [write](const torch::Tensor& b, const std::string& f, int64_t block_size, int64_t queue_depth,
                       bool single_submit, bool overlap_events, bool validate) {
            py::gil_scoped_release nogil;
            AioHandle h(block_size, queue_depth, single_submit, overlap_events, 1, "auto");
            return checked(h, b, f, write, validate, false, 0, 1);
        };
    };
    m.def("aio_read", one_shot(false), arg("buffer"), arg("filename"), arg("block_size"), arg("queue_depth"),
          arg("single_submit"), arg("overlap_events"), arg("validate"));
    m.def("aio_write", one_shot(true), arg("buffer"), arg("filename"), arg("block_size"), arg("queue_depth"),
          arg("single_submit"), arg("overlap_events"), arg("validate"));
    m.def("deepspeed_memcpy", [](torch::Tensor& dest, const torch::Tensor& src) {
        TORCH_CHECK_VALUE(dest.numel() * dest.element_size() == src.numel() * src.element_size(),
                          "deepspeed_memcpy: sizes differ");
        std::memcpy(dest.data_ptr(), src.data_ptr(), src.numel() * src.element_size());
        return 0;
    });
    m.def("libaio_compiled", &libaio_compiled, "True when the libaio backend was compiled in");
}
