/*
 * capstore: safety of the publisher lease and the fenced publish
 * (DESIGN.md sections 6 and 7; src/catalog/lease/, src/catalog/publish.rs).
 *
 * Small enough for an EXHAUSTIVE search.  One Promela process, the world, whose
 * every option is one atomic step of a publisher, of the ClickHouse server, or
 * of time.  specs/README.md says what each step stands for and what is left out.
 *
 * Time: one server clock in ticks.  Everything stored is "ticks left", so the
 * state space is finite and covers unbounded runs.  Terms and versions are
 * stored relative to the head term and to max(version).
 *
 * Local clocks are abstracted: over any interval, local elapsed time and server
 * elapsed time differ by at most SR ticks (the real skew).  Instead of a local
 * clock per publisher, every local duration is converted to server ticks with
 * its worst case for safety, independently per interval (an over-approximation
 * of "bounded lag"):
 *   local deadline  sent + TTL - SK - margin (local)  -> TTL - SK + SR server ticks after sending, at the latest
 *   quarantine      TTL (local)                       -> TTL - SR server ticks, at the earliest
 *   embargo         E (local)                         -> E - SR server ticks, at the earliest
 * Every publisher action is optional at every instant, so the earliest/latest
 * choice covers all real timings.
 *
 * Variants (spin -DNAME -a lease_safety.pml); expected verdicts are in check.sh.
 *   (none)        the design, 2 publishers, at most MAXF unknown outcomes
 *   N3            three publishers
 *   STRICT_I3     I3 read literally: the head has exactly our lease id when a publish lands
 *   NO_PT_MARGIN  control: fence margin clock_skew only (no publish_timeout)
 *   REL_NEXT      control: release tombstone at head+1 instead of own term
 *   REL_CUT       a release may cut off a publish in flight (the drain's
 *                 timeout, a compaction publish still running at shutdown):
 *                 then it writes no tombstone, and the lease expires
 *   REL_AT_ONCE   control for REL_CUT: it writes its tombstone all the same
 *   NO_QUAR       control: no quarantine after an unknown outcome
 *   SKEW_BUG      control: real skew 2 > declared skew 1
 *   NO_VCHECK     the publish statement without its version check
 *   STALE_WM      the watermark is cached, refreshed only by own commits
 *                 (with NO_VCHECK: control for I4)
 *   LOST_LITERAL  "a publisher that loses the lease lands nothing until it claims
 *                 again" read as "...until its claim's reply" (see README)
 *   OVERRUN       a publish row lands up to PT+2 ticks after its fence read
 *                 (max_execution_time not honoured by more than clock_skew)
 * Same-spool takeover (publisher 0 is SIGKILLed, publisher 1 has its spool id):
 *   TAKEOVER               claim at once, no embargo (DESIGN 7 as first written)
 *   TAKEOVER EMB_SENT      embargo publish_timeout + clock_skew + 0.1 s counted
 *                          from when the takeover claim was SENT
 *   TAKEOVER EMB_REPLY     the same embargo counted from when the claim's
 *                          read-back said held (the code now)
 *   TAKEOVER EMB_REPLY START_KEEPS_ID OWN_HEAD_AT_ONCE
 *                          control (the code before): a start whose claim went
 *                          unanswered claims again with the same lease id, and a
 *                          claim over its own live head takes no embargo
 *   TAKEOVER ... SOLE_HEAD_ONLY   a contested head is refused even where its
 *                          every lease id is the spool's (the code before
 *                          that takeover; by default it is taken, embargoed)
 *   TAKEOVER ... CONTESTED_AT_ONCE   control: such a contested head taken
 *                          over with no embargo
 * (specs/takeover.pml selects TAKEOVER.)
 */

#ifdef N3
#define N 3
#else
#define N 2
#endif

#ifndef TTL
#define TTL 4           /* lease ttl (takeover.pml: 5)                     */
#endif
#define PT 2            /* publish_timeout = max_execution_time              */
#define SK 1            /* declared clock_skew                               */
#ifdef SKEW_BUG
#define SR 2            /* real skew: larger than declared                   */
#else
#define SR SK
#endif
#define DEL 1           /* a statement is read by the server at most DEL ticks
                           after it was sent; a lease row lands at most DEL
                           ticks after its SELECT was read                  */
#define REL_DEL TTL     /* a release's tombstone may reach the server up to TTL
                           ticks late (the process does not wait for it past
                           request_timeout, which may exceed the TTL)       */
#ifdef OVERRUN
#define PLAND (PT+2)
#else
#define PLAND PT        /* a publish row lands at most PT ticks after its fence read */
#endif
#ifndef MAXF
#define MAXF 2          /* unknown outcomes per run                          */
#endif
#ifndef MAXD
#define MAXD 0          /* lease requests that definitely failed (renewal skipped), per run */
#endif
#ifdef NO_PT_MARGIN
#define FENCE_MARGIN SK
#else
#define FENCE_MARGIN (PT+SK)   /* 0.1 s and the resolution term: below one tick */
#endif
#define DL0 (TTL-SK+SR)        /* latest server time of the local deadline   */
#define QUAR_T (TTL-SR)        /* earliest server end of a quarantine        */
/* takeover embargo: PT + SK + 0.1 s local; the 0.1 s (strict margin) is one tick */
#define EMB_T (PT+SK+1-SR)

/* lease ids: CUR(i) is publisher i's current lease id, OLD(i) all its earlier ones */
#define NID (2*N+1)
#define CUR(i) (2*(i)+1)
#define OLD(i) (2*(i)+2)
#define ABS 15

/* publisher states */
#define NONE 0
#define HELD 1
#define QUAR 2
#define OFF 3           /* released and exited, or not started yet          */
#define DEAD 4          /* SIGKILLed                                         */

/* lease statement kinds */
#define K_CLAIM 0
#define K_RENEW 1
#define K_TOMB 2

/* relative terms: 2 = head+1, 1 = head, 0 = below the head */

/* ---- ClickHouse -------------------------------------------------------- */
byte hx[NID];           /* per lease id: ABS, or ticks to the expiry (min over its rows) at the head term */
byte nf;                /* unknown outcomes so far */

/* ---- publishers -------------------------------------------------------- */
byte st[N];
byte dl[N];             /* server ticks left on the local deadline (latest case) */
byte q[N];              /* server ticks of quarantine left (earliest case)      */
bit  mtb[N];            /* own term is below the head (else: is the head)       */
bit  lw[N];             /* STALE_WM: cached watermark is current                */
bit  tr[N];             /* the keeper already acted this tick (claim, renew, or a failed request) */
bit  eh[N];             /* held the lease once: a start (acquire_at_start) is over */
byte nd;                /* requests that definitely failed so far              */
#ifdef TAKEOVER
byte emb[N];            /* embargo ticks left (server, earliest case)           */
#endif

/* ---- the lease statement of each publisher (one at a time) ------------- */
byte cph[N];            /* 0 free, 1 sent, 2 WHERE read, 3 settled              */
byte ck[N];             /* K_CLAIM, K_RENEW, K_TOMB                              */
byte ct[N];             /* target term, relative                                */
bit  cok[N];            /* its WHERE passed                                     */
byte clid[N];
byte cdl[N];            /* the local deadline it would give, counting from sending */
byte cexp[N];           /* ticks to the expiry of the row it writes (from the read) */
bit  corph[N];          /* nobody waits for its reply                           */
bit  ccont[N];          /* its term has another lease id: read-back says contested */
bit  ctk[N];            /* a claim over a live head (a same-spool takeover, or its own): embargoed */

/* ---- publish statements: slot i of publisher i; slot N+i only with NO_QUAR */
#ifdef NO_QUAR
#define NS (2*N)
#else
#define NS N
#endif
byte pph[NS];           /* 0 free, 1 sent, 2 WHERE read, 3 settled              */
byte pd[NS];            /* V - max(version) + 1: 2 = next version, 1 = taken, 0 = older */
bit  pok[NS];
byte plid[NS];
byte pc[NS];            /* ticks before the server must act                      */
bit  porph[NS];
bit  pus[NS];           /* ghost: another lease id was held after it was sent    */

#ifdef NOHIDDEN
#define HID             /* for BFS (shortest traces): spin -DNOHIDDEN, gcc -DBFS */
#else
#define HID hidden
#endif
HID byte hn, hsole, hmx, j, hlive, ok;

/* property markers, always 0: they name the property in pan's message */
bit I3_publisher_held_head_lease;
bit I3_serial_publishes;
bit I4_versions_gapless_increasing;
bit NO_OVERLAPPING_BELIEF;
bit LOST_LEASE_PUBLISHES_NOTHING;

#ifdef TRACE_ON
#define TRACE(x) x
#else
#define TRACE(x) skip
#endif

inline headinfo() {
  hn = 0; hsole = 0; hmx = 0; j = 1;
  do
  :: j < NID ->
     if
     :: hx[j] != ABS -> hn++; hsole = j; if :: hx[j] > hmx -> hmx = hx[j] :: else fi
     :: else
     fi; j++
  :: else -> break
  od;
  hlive = (hmx > 0);
  if :: hn != 1 -> hsole = 0 :: else fi
}

#ifdef TAKEOVER
#ifdef N3
#error "TAKEOVER models two publishers of one spool"
#endif
/* a head of publisher 0's lease ids only (publisher 1 may take over all of them; publisher 0 never meets
   publisher 1's, as 1 starts once 0 is dead: the restriction only mirrors the code's rule) */
#define OWN_IDS_ONLY(i) ((i) == 1 || (hx[CUR(1)] == ABS && hx[OLD(1)] == ABS))
#ifdef SOLE_HEAD_ONLY
#define SPOOL_CONTESTED(i) 0
#else
/* a contested live head whose every lease id is the spool's (LeaseStore::claim) */
#define SPOOL_CONTESTED(i) (hn > 1 && OWN_IDS_ONLY(i))
#endif
/* a live head of the spool's: the other process's, or an earlier lease id of its own, or a contested one of the
   spool's lease ids */
#define TAKES(i) (hsole == OLD(i) || ((i) == 1 && (hsole == CUR(0) || hsole == OLD(0))) || SPOOL_CONTESTED(i))
#else
#define TAKES(i) 0
#endif

inline head_moved() {   /* a row landed at head+1 */
  j = 0;
  do
  :: j < N ->
     if :: cph[j] != 0 && ct[j] > 0 -> ct[j]-- :: else fi;
     mtb[j] = 1;
     j++
  :: else -> break
  od
}

inline genchange(i) {   /* LeaseKeeper::step after a quarantine: a fresh lease_id */
  if
  :: hx[CUR(i)] != ABS ->
     if :: hx[OLD(i)] == ABS || hx[CUR(i)] < hx[OLD(i)] -> hx[OLD(i)] = hx[CUR(i)] :: else fi;
     hx[CUR(i)] = ABS
  :: else
  fi;
  if :: cph[i] != 0 && clid[i] == CUR(i) -> clid[i] = OLD(i) :: else fi;
  if :: pph[i] != 0 && plid[i] == CUR(i) -> plid[i] = OLD(i) :: else fi
#ifdef NO_QUAR
  ; if :: pph[N+i] != 0 && plid[N+i] == CUR(i) -> plid[N+i] = OLD(i) :: else fi
#endif
}

inline orphan_all(i) {
  if :: cph[i] == 3 -> cph[i] = 0 :: cph[i] != 0 -> corph[i] = 1 :: else fi;
  if :: pph[i] == 3 -> pph[i] = 0 :: pph[i] != 0 -> porph[i] = 1 :: else fi
#ifdef NO_QUAR
  ; if :: pph[N+i] == 3 -> pph[N+i] = 0 :: pph[N+i] != 0 -> porph[N+i] = 1 :: else fi
#endif
}

/* LeaseHandle::report_unknown_outcome / LeaseKeeper::apply (Err OutcomeUnknown) */
inline quarantine(i) {
  st[i] = QUAR; q[i] = QUAR_T; dl[i] = 0; orphan_all(i)
}

/* LeaseStore::claim (read_head, refuse or INSERT..SELECT at head+1) and
   LeaseStore::renew (INSERT at own term+1, WHERE own term is the live head) */
inline claim_send(i) {
  TRACE(printf("claim_send P%d st %d\n", i, st[i]));
  tr[i] = 1;
  cph[i] = 1; cok[i] = 0; clid[i] = CUR(i); cdl[i] = DL0; cexp[i] = 0;
  corph[i] = 0; ccont[i] = 0; ctk[i] = 0;
  if
  :: st[i] == HELD -> ck[i] = K_RENEW; ct[i] = 2 - mtb[i]
  :: else ->
     ck[i] = K_CLAIM; ct[i] = 2;
     headinfo();
     if
     :: hlive && hsole != CUR(i) ->
        if
#ifdef CONTESTED_AT_ONCE
        :: hn > 1 && TAKES(i) -> skip
        :: hn <= 1 && TAKES(i) -> ctk[i] = 1
#else
        :: TAKES(i) -> ctk[i] = 1
#endif
        :: else -> cph[i] = 0        /* refused */
        fi
#ifndef OWN_HEAD_AT_ONCE
     :: hlive && hsole == CUR(i) -> ctk[i] = 1
#endif
     :: else
     fi
  fi
}

/* the server reads the statement's WHERE */
inline claim_eval(i) {
  TRACE(printf("claim_eval P%d\n", i));
  if
  :: ck[i] == K_CLAIM -> cok[i] = (ct[i] == 2)
  :: ck[i] == K_RENEW -> cok[i] = (ct[i] == 2 && hx[clid[i]] != ABS && hx[clid[i]] > 0)
  :: else ->
#ifdef REL_NEXT
     ct[i] = 2;
#endif
     cok[i] = 1
  fi;
  cexp[i] = TTL; cph[i] = 2
}

/* its row becomes visible */
inline claim_land(i) {
  TRACE(printf("claim_land P%d ct %d ok %d\n", i, ct[i], cok[i]));
  if :: ck[i] == K_TOMB -> cexp[i] = 0 :: else fi;
  if
  :: cok[i] && ct[i] == 2 ->
     j = 1; do :: j < NID -> hx[j] = ABS; j++ :: else -> break od;
     hx[clid[i]] = cexp[i]; head_moved(); ct[i] = 1
#ifndef LOST_LITERAL
     /* its lease id heads the lease again: a publish of that lease id still
        in flight is no longer a publish by a process that lost the lease */
     ; j = 0;
     do :: j < NS -> if :: pph[j] != 0 && plid[j] == clid[i] -> pus[j] = 0 :: else fi; j++
     :: else -> break
     od
#endif
  :: cok[i] && ct[i] == 1 ->
     j = 1;
     do
     :: j < NID -> if :: j != clid[i] && hx[j] != ABS -> ccont[i] = 1 :: else fi; j++
     :: else -> break
     od;
     j = 0;
     do
     :: j < N -> if :: j != i && cph[j] == 3 && cok[j] && ct[j] == 1 && clid[j] != clid[i] -> ccont[j] = 1 :: else fi; j++
     :: else -> break
     od;
     if :: hx[clid[i]] == ABS || cexp[i] < hx[clid[i]] -> hx[clid[i]] = cexp[i] :: else fi
  :: cok[i] && ct[i] == 0 -> ccont[i] = 1   /* below the head: another row took its term first */
  :: else
  fi;
  cexp[i] = 0;
  if :: corph[i] -> cph[i] = 0 :: else -> cph[i] = 3 fi
}

/* the reply, and the read-back of the term (insert_and_read_back); LeaseKeeper::apply / apply_held */
inline claim_reply(i) {
  TRACE(printf("claim_reply P%d ok %d cont %d\n", i, cok[i], ccont[i]));
  if
  :: cok[i] && !ccont[i] && cdl[i] > 0 ->
     j = 0;
     do
     :: j < N -> assert(j == i || !(st[j] == HELD && dl[j] > 0) || NO_OVERLAPPING_BELIEF); j++
     :: else -> break
     od;
     j = 0;
     do
     :: j < NS -> if :: pph[j] != 0 && plid[j] != clid[i] -> pus[j] = 1 :: else fi; j++
     :: else -> break
     od;
#ifdef TAKEOVER
     if
     :: ctk[i] ->
#ifdef EMB_SENT
        if :: EMB_T > DL0 - cdl[i] -> emb[i] = EMB_T - (DL0 - cdl[i]) :: else -> emb[i] = 0 fi
#elif defined(EMB_REPLY)
        emb[i] = EMB_T
#else
        emb[i] = 0
#endif
     :: else
     fi;
#endif
     st[i] = HELD; dl[i] = cdl[i]; mtb[i] = (ct[i] == 0); eh[i] = 1
  :: else -> st[i] = NONE; dl[i] = 0
  fi;
  cph[i] = 0
}

/* LeaseKeeper::release -> LeaseStore::release: tombstone at own term, then exit.
   A publish in flight is cut off (the drain's timeout): it may still run on
   the server, and then no tombstone is written (LeaseHandle::commit_sent).
   From the release on, no publish is sent (the permit and commit_sent read
   the same flag the release sets). */
inline release(i) {
  TRACE(printf("release P%d\n", i));
#ifndef REL_CUT
#ifndef REL_AT_ONCE
  assert(!(pph[i] != 0 && !porph[i]));      /* the drain let every publish end */
#endif
#endif
#ifdef REL_AT_ONCE
  ok = 1;
#else
  ok = !(pph[i] != 0 && !porph[i]);         /* no commit unanswered (PBUSY) */
#endif
  if :: pph[i] == 3 -> pph[i] = 0 :: pph[i] != 0 -> porph[i] = 1 :: else fi;
  if
  :: ok ->
     cph[i] = 1; ck[i] = K_TOMB; ct[i] = 1 - mtb[i]; cok[i] = 0; clid[i] = CUR(i);
     cdl[i] = DL0; cexp[i] = 0; corph[i] = 1; ccont[i] = 0; ctk[i] = 0
  :: else
  fi;
  st[i] = OFF; dl[i] = 0
}

/* Publisher::publish_batch: permit, V = watermark + 1, fenced INSERT..SELECT */
inline pub_send(i, s) {
  TRACE(printf("pub_send P%d slot %d\n", i, s));
  pph[s] = 1;
#ifdef STALE_WM
  pd[s] = 1 + lw[i];
#else
  pd[s] = 2;
#endif
  pok[s] = 0; plid[s] = CUR(i); pc[s] = DEL; porph[s] = 0; pus[s] = 0
}

/* fence_condition AND max(version) = V - 1, read when the SELECT runs.  The
   code reads only the publishes at or above V - 1; their max is V - 1 exactly
   when pd == 2.  (A V is never above max + 1, so this is also the first wave's
   "max(version) < V": the stronger form costs O(1) and changes no verdict.) */
inline pub_eval(s) {
  TRACE(printf("pub_eval slot %d\n", s));
  headinfo();
#ifdef NO_VCHECK
  pok[s] = (hn == 1 && hsole == plid[s] && hx[hsole] > FENCE_MARGIN);
#else
  pok[s] = (hn == 1 && hsole == plid[s] && hx[hsole] > FENCE_MARGIN && pd[s] == 2);
#endif
  if
  :: pok[s] ->   /* publishes are serial across lease ids: no other lease id's
                    fenced publish is still running when ours passes its fence */
     j = 0;
     do
     :: j < NS -> assert(j == s || !(pph[j] == 2 && pok[j] && plid[j] != plid[s]) || I3_serial_publishes); j++
     :: else -> break
     od
  :: else
  fi;
  pph[s] = 2; pc[s] = PLAND
}

inline pub_land(i, s) {
  TRACE(printf("pub_land P%d slot %d ok %d\n", i, s, pok[s]));
  if
  :: pok[s] ->
     headinfo();
#ifdef STRICT_I3
     ok = (hn == 1 && hsole == plid[s] && hlive);
#elif defined(TAKEOVER) && !defined(LITERAL_I3)
     ok = 1;    /* takeover.pml: the embargo does not stop a dead predecessor's
                   fenced row from landing after the takeover claim; checked
                   instead: I3_serial_publishes and I4 (see README) */
#else
     /* its lease id is live at the head term, and no other publisher
        believes it holds a lease id that is at the head term            */
     ok = (hx[plid[s]] != ABS && hx[plid[s]] > 0);
     j = 0;
     do
     :: j < N -> if :: st[j] == HELD && dl[j] > 0 && CUR(j) != plid[s] && hx[CUR(j)] != ABS -> ok = 0 :: else fi; j++
     :: else -> break
     od;
#endif
     assert(ok || I3_publisher_held_head_lease);
     assert(pd[s] == 2 || I4_versions_gapless_increasing);
#if !defined(TAKEOVER) || defined(LITERAL_I3)
     assert(!pus[s] || LOST_LEASE_PUBLISHES_NOTHING);
#endif
     j = 0;
     do :: j < NS -> if :: j != s && pph[j] != 0 && pd[j] > 0 -> pd[j]-- :: else fi; j++
     :: else -> break
     od;
     j = 0;
     do :: j < N -> lw[j] = 0; j++ :: else -> break od;
     lw[i] = 1
  :: else
  fi;
  if :: porph[s] -> pph[s] = 0 :: else -> pph[s] = 3 fi
}

/* Publisher::read_back by publish_id: absent -> report_fence_refused (the
   keeper renews at once; modelled as: the renewal may be sent at any time) */
inline pub_reply(i, s) {
  TRACE(printf("pub_reply P%d slot %d\n", i, s));
  pph[s] = 0
}

/* ---- time ------------------------------------------------------------ */
inline tick() {
  TRACE(printf("tick\n"));
  j = 0; do :: j < N -> tr[j] = 0; j++ :: else -> break od;
  j = 1;
  do :: j < NID -> if :: hx[j] != ABS && hx[j] > 0 -> hx[j]-- :: else fi; j++
  :: else -> break
  od;
  j = 0;
  do
  :: j < N ->
     if :: cph[j] != 0 && cdl[j] > 0 -> cdl[j]-- :: else fi;
     if :: cph[j] == 2 -> cexp[j]-- :: else fi;
     if
     :: st[j] == HELD -> if :: dl[j] > 1 -> dl[j]-- :: else -> dl[j] = 0; st[j] = NONE fi
     :: st[j] == QUAR -> if :: q[j] > 1 -> q[j]-- :: else -> q[j] = 0; st[j] = NONE; genchange(j) fi
     :: else
     fi;
#ifdef TAKEOVER
     if :: emb[j] > 0 -> emb[j]-- :: else fi;
#endif
     j++
  :: else -> break
  od;
  j = 0;
  do :: j < NS -> if :: pph[j] == 1 || pph[j] == 2 -> pc[j]-- :: else fi; j++
  :: else -> break
  od
}

/* the server must act on a statement before its bound runs out */
#ifdef LAZY_REPLY
#define RDUE(c) 0
#else
#define RDUE(c) (c)
#endif
#define CDUE(i) ((cph[i] == 1 && cdl[i] <= DL0 - (ck[i] == K_TOMB -> REL_DEL : DEL)) || (cph[i] == 2 && cexp[i] <= TTL - DEL) || RDUE(cph[i] == 3 && !corph[i]))
/* the keeper claims or renews every tick (ttl/6 is below one tick), unless
   the request definitely failed (at most MAXD times per run) */
#define KDUE(i) ((st[i] == NONE || st[i] == HELD) && cph[i] == 0 && !tr[i])
#define PDUE(s) (((pph[s] == 1 || pph[s] == 2) && pc[s] == 0) || RDUE(pph[s] == 3 && !porph[s]))

#ifdef N3
#define CDUE_ALL (CDUE(0) || CDUE(1) || CDUE(2) || KDUE(0) || KDUE(1) || KDUE(2))
#else
#define CDUE_ALL (CDUE(0) || CDUE(1) || KDUE(0) || KDUE(1))
#endif
#if defined(NO_QUAR) && defined(N3)
#define PDUE_ALL (PDUE(0) || PDUE(1) || PDUE(2) || PDUE(3) || PDUE(4) || PDUE(5))
#elif defined(NO_QUAR)
#define PDUE_ALL (PDUE(0) || PDUE(1) || PDUE(2) || PDUE(3))
#elif defined(N3)
#define PDUE_ALL (PDUE(0) || PDUE(1) || PDUE(2))
#else
#define PDUE_ALL (PDUE(0) || PDUE(1))
#endif

#define RUNS(i) (st[i] == NONE || st[i] == HELD || st[i] == QUAR)
#if defined(REL_CUT) || defined(REL_AT_ONCE)
#define REL_CUTS 1      /* a release may cut off a publish in flight */
#else
#define REL_CUTS 0
#endif
#define PBUSY(i) (pph[i] != 0 && !porph[i])

#ifdef TAKEOVER
#define PERMIT(i) (st[i] == HELD && dl[i] > 0 && emb[i] == 0)
#define CAN_RELEASE 0
#else
#define PERMIT(i) (st[i] == HELD && dl[i] > 0)
#define CAN_RELEASE 1
#endif

/* An unknown outcome quarantines, except a claim's at start with START_FRESH_ID
   (acquire_at_start claims again at once with a fresh lease id; takeover.pml)
   or START_KEEPS_ID (the code before: again at once with the same lease id) */
#if defined(START_KEEPS_ID)
#define START_UNKNOWN(i) if :: eh[i] -> QUARANTINE(i) :: else -> st[i] = NONE fi
#elif defined(START_FRESH_ID)
#define START_UNKNOWN(i) if :: eh[i] -> QUARANTINE(i) :: else -> st[i] = NONE; genchange(i) fi
#else
#define START_UNKNOWN(i) QUARANTINE(i)
#endif

#define PSLOT(i, s) \
  :: d_step { pph[s] == 1 -> pub_eval(s) } \
  :: d_step { pph[s] == 2 -> pub_land(i, s) } \
  :: d_step { pph[s] == 3 && !porph[s] -> pub_reply(i, s) } \
  :: d_step { nf < MAXF && (pph[s] == 1 || pph[s] == 2 || pph[s] == 3) && !porph[s] && RUNS(i) -> \
              nf++; if :: pph[s] == 3 -> pph[s] = 0 :: else -> porph[s] = 1 fi; QUARANTINE(i) }

#ifdef NO_QUAR
#define QUARANTINE(i) skip
#define PSLOT2(i) PSLOT(i, N+i) \
  :: d_step { PERMIT(i) && pph[i] != 0 && pph[N+i] == 0 -> pub_send(i, N+i) }
#else
#define QUARANTINE(i) quarantine(i)
#define PSLOT2(i)
#endif

/* The permit (LeaseHandle::permit) is taken as "held and the local deadline
   not passed": its publish_timeout + clock_skew margin is not relied on.
   One publish at a time per process (publish_batch awaits its read-back). */
#define PUB(i) \
  :: d_step { (st[i] == NONE || st[i] == HELD) && cph[i] == 0 && !tr[i] -> claim_send(i) } \
  :: d_step { (st[i] == NONE || st[i] == HELD) && cph[i] == 0 && !tr[i] && nd < MAXD -> nd++; tr[i] = 1 } \
  :: d_step { cph[i] == 1 -> claim_eval(i) } \
  :: d_step { cph[i] == 2 -> claim_land(i) } \
  :: d_step { cph[i] == 3 && !corph[i] -> claim_reply(i) } \
  :: d_step { nf < MAXF && cph[i] != 0 && !corph[i] && RUNS(i) -> \
              nf++; if :: cph[i] == 3 -> cph[i] = 0 :: else -> corph[i] = 1 fi; \
              START_UNKNOWN(i) } \
  :: d_step { CAN_RELEASE && st[i] == HELD && cph[i] == 0 && (REL_CUTS || !PBUSY(i)) -> release(i) } \
  :: d_step { CAN_RELEASE && st[i] == OFF && cph[i] == 0 && pph[i] == 0 -> genchange(i); st[i] = NONE; mtb[i] = 1; eh[i] = 0 } \
  :: d_step { PERMIT(i) && !PBUSY(i) && pph[i] == 0 -> pub_send(i, i) } \
  PSLOT(i, i) PSLOT2(i)

init {
  d_step {
    j = 1; do :: j < NID -> hx[j] = ABS; j++ :: else -> break od;
    j = 0; do :: j < N -> mtb[j] = 1; lw[j] = 1; j++ :: else -> break od
#ifdef TAKEOVER
    ; st[1] = OFF
#endif
    ; skip
  };
  do
  PUB(0)
  PUB(1)
#ifdef N3
  PUB(2)
#endif
  :: d_step { !CDUE_ALL && !PDUE_ALL -> tick(); skip }
#ifdef TAKEOVER
  /* SIGKILL of publisher 0; publisher 1 (same spool id) gets the flock */
  :: d_step { st[0] != DEAD && st[1] == OFF -> TRACE(printf("SIGKILL P0, P1 starts\n"));
              st[0] = DEAD; dl[0] = 0; orphan_all(0); st[1] = NONE }
#endif
  od
}
