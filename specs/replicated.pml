/*
 * capstore: the lease and the fenced publish on a REPLICATED catalog
 * (src/catalog/client.rs "Replicated catalogs"; specs/README.md).
 *
 * Two publishers P0, P1 against a catalog kept on 3 replicas.  Small enough
 * for an EXHAUSTIVE search.  One Promela process, the world; every option is
 * one step of a publisher, of the server, or of replication.
 *
 * Catalog: per replica, the set of rows it holds (bit masks).
 *   lease rows      claim row L(t,p) and tombstone T(t,p), terms 1..MAXT,
 *                   lease id = publisher id (a restarted publisher reuses it:
 *                   its rows at a new term are new rows anyway)
 *   publish rows    PB(v,p), versions 1..MAXV
 * Writes are quorum inserts: a row lands on one replica (any), reaches the
 * others one replica at a time (asynchronous fetch, at any later instant), and
 * the insert is acknowledged once 2 of 3 replicas hold it.  The writer waits
 * for the acknowledgement (a release's tombstone is not waited for).
 * Deciding reads (head read, claim WHERE, read-back, fence, version check) are
 * sequentially consistent: each returns the union of the rows of SOME majority
 * of replicas (chosen anew per read and per subquery), so every acknowledged
 * row and possibly some unacknowledged ones.
 * Which replica a write lands on and which majority a read sees are chosen anew
 * for every statement, so a client that fails over between replicas
 * (catalog.replica_urls) between any two statements is inside the model.
 *
 * Time is left out: leases do not expire and are not renewed, so the only way
 * to a new term is a release (tombstone at own term; only below MAXT, as no
 * claim could follow it), after which the publisher may start again.  No
 * faults (every reply arrives).  Bounds: MAXT terms, MAXV versions.  V is chosen freely in
 * 1..MAXV (any watermark, stale or not): the version check alone decides.
 *
 * Variants (spin -DNAME -a replicated.pml); expected verdicts are in check.sh.
 *   (none)        quorum inserts + sequentially consistent deciding reads
 *   STALE_READS   control: every deciding read comes from ONE arbitrary
 *                 replica (select_sequential_consistency = 0)
 *   STALE_VCHECK  control: only the version check reads one replica (the
 *                 lease reads and the fence stay sequentially consistent)
 *   STALE_LEASE   control: only the claim's reads (head, WHERE, read-back)
 *                 read one replica (fence and version check stay sequentially
 *                 consistent): two publishers hold one term
 *   NO_TERM_CHECK NO_SHARED_TERM not asserted (with STALE_LEASE: a stale head
 *                 read lets a claim at term 2 pass over a live holder whose
 *                 publish is still unacknowledged; the fence cannot help,
 *                 both publish one version)
 *
 * Properties (the marker in pan's message names the property):
 *   NO_SHARED_TERM     when a read-back makes a publisher holder of term t, the
 *                      other publisher does not hold term t
 *   NO_DOUBLE_PUBLISH  when a publish row lands (on its first replica), no
 *                      publish row at its version exists on any replica
 */

#define MAXT 2
#define MAXV 2

#define L(t,p)  (1 << (((t)-1)*2 + (p)))
#define T(t,p)  (1 << (4 + ((t)-1)*2 + (p)))
#define TERMBITS(t) (L(t,0) | L(t,1) | T(t,0) | T(t,1))
#define MAXTERM(S) (((S) & TERMBITS(2)) -> 2 : (((S) & TERMBITS(1)) -> 1 : 0))
#define LIVE(S,t,p) (((S) & L(t,p)) != 0 && ((S) & T(t,p)) == 0)
#define PB(v,p) (1 << (((v)-1)*2 + (p)))
#define VBITS(v) (PB(v,0) | PB(v,1))
/* publish rows at version >= v */
#define GE(v) (((1 << (2*MAXV)) - 1) & ~((1 << (2*((v)-1))) - 1))
#define CNT(A,b) (((A[0] & (b)) != 0) + ((A[1] & (b)) != 0) + ((A[2] & (b)) != 0))
#define ANY(A) (A[0] | A[1] | A[2])

#define NONE 0
#define HELD 1
#define OFF  2

byte lrep[3];     /* lease rows per replica   */
byte prep[3];     /* publish rows per replica */

byte st[2];       /* NONE, HELD, OFF                                          */
byte term[2];     /* term held                                                */
byte cph[2];      /* claim: 0 idle, 1 sent (WHERE not read), 2 WHERE passed,
                     3 row landed (awaiting quorum ack)                        */
byte ct[2];       /* claim's term (head + 1)                                  */
byte pph[2];      /* publish: 0 idle, 1 sent, 2 fence passed, 3 row landed    */
byte pv[2];       /* publish's version V                                      */

byte S, S2;       /* scratch, reset to 0 at the end of every step */
byte k;

bit NO_SHARED_TERM;
bit NO_DOUBLE_PUBLISH;

/* a deciding read of table A: option m of 3 (a majority, or STALE: one replica).
   CREAD: the claim's reads (head, WHERE, read-back); FREAD: the fence; VREAD: the version check */
#define MAJ(A, m) ((m) == 0 -> (A[1] | A[2]) : ((m) == 1 -> (A[0] | A[2]) : (A[0] | A[1])))
#define ONE(A, m) A[m]
#ifdef STALE_READS
#define FREAD(A, m) ONE(A, m)
#else
#define FREAD(A, m) MAJ(A, m)
#endif
#if defined(STALE_READS) || defined(STALE_LEASE)
#define CREAD(A, m) ONE(A, m)
#else
#define CREAD(A, m) MAJ(A, m)
#endif
#if defined(STALE_READS) || defined(STALE_VCHECK)
#define VREAD(A, m) ONE(A, m)
#else
#define VREAD(A, m) MAJ(A, m)
#endif

/* LeaseStore::claim: read_head; refuse if another lease id is live at the
   head term; else INSERT .. SELECT a row at head + 1 WHERE head = h */
inline claim_send(i, m) {
  S = CREAD(lrep, m);
  k = MAXTERM(S);
  if
  :: k >= MAXT -> skip                                   /* bound: no term left */
  :: k > 0 && LIVE(S, k, 1-i) -> skip                    /* refused */
  :: else -> ct[i] = k + 1; cph[i] = 1
  fi;
  S = 0; k = 0
}

/* the server reads the WHERE (one instant) */
inline claim_eval(i, m) {
  S = CREAD(lrep, m);
  if
  :: MAXTERM(S) == ct[i] - 1 -> cph[i] = 2
  :: else -> cph[i] = 0; ct[i] = 0                       /* raced: refused */
  fi;
  S = 0
}

/* the acknowledgement, then the read-back of the term (insert_and_read_back):
   exactly our row -> held, more rows -> contested */
inline claim_reply(i, m) {
  S = CREAD(lrep, m);
  if
  :: (S & TERMBITS(ct[i])) == L(ct[i], i) ->
#ifndef NO_TERM_CHECK
     assert(!(st[1-i] == HELD && term[1-i] == ct[i]) || NO_SHARED_TERM);
#endif
     st[i] = HELD; term[i] = ct[i]
  :: else -> skip                                        /* contested */
  fi;
  cph[i] = 0; ct[i] = 0; S = 0
}

/* fence_condition AND max(version) < V, both read when the SELECT runs
   (each subquery from its own majority) */
inline pub_eval(i, m, n) {
  S = FREAD(lrep, m);
  S2 = VREAD(prep, n);
  if
  :: (MAXTERM(S) == term[i]) && ((S & TERMBITS(term[i])) == L(term[i], i)) && ((S2 & GE(pv[i])) == 0) -> pph[i] = 2
  :: else -> pph[i] = 0; pv[i] = 0                       /* refused */
  fi;
  S = 0; S2 = 0
}

inline pub_land(i, r) {
  assert((ANY(prep) & VBITS(pv[i])) == 0 || NO_DOUBLE_PUBLISH);
  prep[r] = prep[r] | PB(pv[i], i); pph[i] = 3
}

/* replication: replica r fetches one row it lacks that another replica holds */
#define RL(r, b) :: d_step { (lrep[r] & (b)) == 0 && (ANY(lrep) & (b)) != 0 -> lrep[r] = lrep[r] | (b) }
#define RP(r, b) :: d_step { (prep[r] & (b)) == 0 && (ANY(prep) & (b)) != 0 -> prep[r] = prep[r] | (b) }
#define REPL(r) RL(r, 1) RL(r, 2) RL(r, 4) RL(r, 8) RL(r, 16) RL(r, 32) \
                RP(r, 1) RP(r, 2) RP(r, 4) RP(r, 8)

#define PEVAL(i, m) \
  :: d_step { pph[i] == 1 -> pub_eval(i, m, 0) } \
  :: d_step { pph[i] == 1 -> pub_eval(i, m, 1) } \
  :: d_step { pph[i] == 1 -> pub_eval(i, m, 2) }

#define PUB(i) \
  :: d_step { st[i] == NONE && cph[i] == 0 -> claim_send(i, 0) } \
  :: d_step { st[i] == NONE && cph[i] == 0 -> claim_send(i, 1) } \
  :: d_step { st[i] == NONE && cph[i] == 0 -> claim_send(i, 2) } \
  :: d_step { cph[i] == 1 -> claim_eval(i, 0) } \
  :: d_step { cph[i] == 1 -> claim_eval(i, 1) } \
  :: d_step { cph[i] == 1 -> claim_eval(i, 2) } \
  :: d_step { cph[i] == 2 -> lrep[0] = lrep[0] | L(ct[i], i); cph[i] = 3 } \
  :: d_step { cph[i] == 2 -> lrep[1] = lrep[1] | L(ct[i], i); cph[i] = 3 } \
  :: d_step { cph[i] == 2 -> lrep[2] = lrep[2] | L(ct[i], i); cph[i] = 3 } \
  :: d_step { cph[i] == 3 && CNT(lrep, L(ct[i], i)) >= 2 -> claim_reply(i, 0) } \
  :: d_step { cph[i] == 3 && CNT(lrep, L(ct[i], i)) >= 2 -> claim_reply(i, 1) } \
  :: d_step { cph[i] == 3 && CNT(lrep, L(ct[i], i)) >= 2 -> claim_reply(i, 2) } \
  /* Publisher::publish_batch, one publish at a time */ \
  :: d_step { st[i] == HELD && pph[i] == 0 -> pv[i] = 1; pph[i] = 1 } \
  :: d_step { st[i] == HELD && pph[i] == 0 -> pv[i] = 2; pph[i] = 1 } \
  PEVAL(i, 0) PEVAL(i, 1) PEVAL(i, 2) \
  :: d_step { pph[i] == 2 -> pub_land(i, 0) } \
  :: d_step { pph[i] == 2 -> pub_land(i, 1) } \
  :: d_step { pph[i] == 2 -> pub_land(i, 2) } \
  :: d_step { pph[i] == 3 && CNT(prep, PB(pv[i], i)) >= 2 -> pph[i] = 0; pv[i] = 0 } \
  /* LeaseStore::release: tombstone at own term on one replica, not waited for */ \
  :: d_step { st[i] == HELD && pph[i] == 0 && term[i] < MAXT -> lrep[0] = lrep[0] | T(term[i], i); st[i] = OFF; term[i] = 0 } \
  :: d_step { st[i] == HELD && pph[i] == 0 && term[i] < MAXT -> lrep[1] = lrep[1] | T(term[i], i); st[i] = OFF; term[i] = 0 } \
  :: d_step { st[i] == HELD && pph[i] == 0 && term[i] < MAXT -> lrep[2] = lrep[2] | T(term[i], i); st[i] = OFF; term[i] = 0 } \
  /* a new process of that publisher starts */ \
  :: d_step { st[i] == OFF -> st[i] = NONE }

init {
  do
  PUB(0)
  PUB(1)
  REPL(0)
  REPL(1)
  REPL(2)
  od
}
