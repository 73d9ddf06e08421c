//! Threads for a worker's attempts that outlive them: a thread that finished an
//! attempt waits a while for the next one instead of ending, and a new thread starts
//! only when none is idle. Starting a thread per attempt cost a clone, a stack and an
//! exit per step at thousands of steps a second. Each job still has a thread of its
//! own while it runs, so a handler past its timeout holds only its own thread (the
//! worker loop reports the timeout; see `worker::Running`). Owns its threads and the
//! queue of jobs handed to idle ones; touches nothing else.

use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Hands jobs to idle threads, or to new ones.
pub(crate) struct Threads {
    name: String,
    /// How long an idle thread waits for a job before it ends.
    linger: Duration,
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    queue: Mutex<Queue>,
    ready: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Threads waiting for a job. Only more idle threads than queued jobs mean a job
    /// handed over now will be taken; changed under the queue's lock only.
    idle: usize,
}

impl Threads {
    pub(crate) fn new(name: &str, linger: Duration) -> Self {
        Self {
            name: name.to_string(),
            linger,
            inner: Arc::default(),
        }
    }

    /// Runs `job` on an idle thread if one is free, else on a new thread; `Err` if a
    /// thread was needed and could not be started (the job is then dropped unrun).
    pub(crate) fn run(&self, job: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        let mut queue = self.inner.queue.lock();
        if queue.idle > queue.jobs.len() {
            queue.jobs.push_back(Box::new(job));
            drop(queue);
            self.inner.ready.notify_one();
            return Ok(());
        }
        drop(queue);
        let (inner, linger) = (self.inner.clone(), self.linger);
        std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || {
                job();
                serve(&inner, linger);
            })
            .map(|_| ())
    }

    /// Threads waiting for a job now.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.inner.queue.lock().idle
    }
}

/// A thread's life after its first job: take queued jobs until none comes for `linger`.
fn serve(inner: &Inner, linger: Duration) {
    let mut queue = inner.queue.lock();
    loop {
        if let Some(job) = queue.jobs.pop_front() {
            drop(queue);
            job();
            queue = inner.queue.lock();
            continue;
        }
        queue.idle += 1;
        let timed_out = inner.ready.wait_for(&mut queue, linger).timed_out();
        queue.idle -= 1;
        // A job queued while the wait timed out is still this thread's to take: `run`
        // counted this thread as idle when it queued it.
        if timed_out && queue.jobs.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_thread_that_finished_a_job_runs_the_next_and_a_busy_one_gets_company() {
        let threads = Threads::new("test-step", Duration::from_secs(60));
        let (done, finished) = mpsc::channel();
        let d = done.clone();
        threads
            .run(move || d.send(std::thread::current().id()).unwrap())
            .unwrap();
        let first = finished.recv().unwrap();
        // The first thread is idle once it waits for a job (no sleep: poll the count).
        while threads.idle() == 0 {
            std::thread::yield_now();
        }
        let d = done.clone();
        threads
            .run(move || d.send(std::thread::current().id()).unwrap())
            .unwrap();
        assert_eq!(finished.recv().unwrap(), first, "the idle thread ran it");
        // A job that blocks keeps its thread: the next job gets another one.
        while threads.idle() == 0 {
            std::thread::yield_now();
        }
        let (release, blocked) = mpsc::channel::<()>();
        threads.run(move || blocked.recv().unwrap()).unwrap();
        threads
            .run(move || done.send(std::thread::current().id()).unwrap())
            .unwrap();
        assert_ne!(finished.recv().unwrap(), first, "a new thread ran it");
        release.send(()).unwrap();
    }

    #[test]
    fn idle_threads_end_after_their_linger_and_jobs_still_run() {
        let threads = Threads::new("test-step", Duration::from_millis(1));
        let (done, finished) = mpsc::channel();
        for i in 0..50 {
            let d = done.clone();
            threads.run(move || d.send(i).unwrap()).unwrap();
        }
        let mut got: Vec<i32> = (0..50).map(|_| finished.recv().unwrap()).collect();
        got.sort();
        assert_eq!(got, (0..50).collect::<Vec<_>>());
    }
}
