//! The bounded pool that disk reads and writes run on: tokio's blocking threads behind a
//! semaphore, so blocking I/O never runs on an async worker and a burst of disk reads can't grow
//! the thread count without bound. A read that can't get a slot in time is answered `Busy`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::error::ServerError;

/// Disk operations in flight at once.
pub const IO_SLOTS: usize = 32;

#[derive(Clone)]
pub struct IoPool {
    slots: Arc<Semaphore>,
}

impl Default for IoPool {
    fn default() -> Self {
        IoPool { slots: Arc::new(Semaphore::new(IO_SLOTS)) }
    }
}

/// Why a job did not run to completion.
#[derive(Debug)]
pub enum IoRefused {
    /// No slot freed within the wait.
    Busy,
    /// The job panicked or the runtime is shutting down.
    Failed(String),
}

impl From<IoRefused> for ServerError {
    fn from(e: IoRefused) -> Self {
        match e {
            IoRefused::Busy => ServerError::Capacity("the disk I/O pool is saturated".into()),
            IoRefused::Failed(why) => ServerError::Io(std::io::Error::other(why)),
        }
    }
}

impl IoPool {
    /// Runs `job` on a blocking thread once a slot is free, waiting at most `wait` for one
    /// (`None`: as long as it takes).
    pub async fn run<T, F>(&self, wait: Option<Duration>, job: F) -> Result<T, IoRefused>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let acquire = self.slots.clone().acquire_owned();
        let permit = match wait {
            Some(w) => tokio::time::timeout(w, acquire).await.map_err(|_| IoRefused::Busy)?,
            None => acquire.await,
        }
        .map_err(|_| IoRefused::Failed("the I/O pool is closed".into()))?;
        tokio::task::spawn_blocking(move || {
            let out = job();
            drop(permit);
            out
        })
        .await
        .map_err(|e| IoRefused::Failed(format!("disk job: {e}")))
    }

    /// Slots free now (for tests and gauges).
    pub fn available(&self) -> usize {
        self.slots.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_saturated_pool_answers_busy_and_frees_its_slots() {
        let pool = IoPool { slots: Arc::new(Semaphore::new(1)) };
        let (release, held) = std::sync::mpsc::channel::<()>();
        let p = pool.clone();
        let first = tokio::spawn(async move { p.run(None, move || held.recv().is_ok()).await });
        while pool.available() > 0 {
            tokio::task::yield_now().await;
        }
        let second = pool.run(Some(Duration::from_millis(50)), || 7).await;
        assert!(matches!(second, Err(IoRefused::Busy)), "{second:?}");
        release.send(()).unwrap();
        assert!(first.await.unwrap().unwrap());
        assert_eq!(pool.run(Some(Duration::from_secs(5)), || 7).await.unwrap(), 7);
        assert_eq!(pool.available(), 1);
    }
}
